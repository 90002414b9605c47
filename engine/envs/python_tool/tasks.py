"""The built-in task set: small problems worth a few lines of Python, each with its checker.

Two kinds: a question whose answer is a number (`NumberAnswer`; the code is for computing it), and a
function to write (`FunctionTests`; the answer is its definition, run against hidden test cases). Each
task also carries a reference solution, a program whose output (number tasks) or whose text (function
tasks) its checker accepts; tests/test_python_tool.py checks every one.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.envs.python_tool.checkers import Checker, FunctionTests, NumberAnswer


@dataclass(frozen=True, slots=True)
class Task:
    id: str
    question: str
    checker: Checker
    reference: str  # number task: code printing the answer; function task: the function's definition


def _number(id: str, question: str, value: float, reference: str, tolerance: float = 0.0) -> Task:
    return Task(
        id, question + " Give the number as the answer.", NumberAnswer(value=value, tolerance=tolerance), reference
    )


def _function(id: str, question: str, name: str, cases: list[tuple[tuple, object]], reference: str) -> Task:
    checker = FunctionTests(name=name, cases=tuple(cases))
    return Task(id, question + f" Give the complete definition of `{name}` as the answer.", checker, reference)


TASKS: tuple[Task, ...] = (
    _number(
        "sum-multiples",
        "What is the sum of all natural numbers below 1000 that are multiples of 3 or 5?",
        233168,
        "print(sum(n for n in range(1000) if n % 3 == 0 or n % 5 == 0))",
    ),
    _number(
        "even-fibonacci",
        "What is the sum of the even Fibonacci numbers (1, 2, 3, 5, 8, ...) not exceeding 4,000,000?",
        4613732,
        "a, b, s = 1, 2, 0\nwhile a <= 4_000_000:\n    s += a * (a % 2 == 0)\n    a, b = b, a + b\nprint(s)",
    ),
    _number(
        "prime-1000",
        "What is the 1000th prime number?",
        7919,
        "ps = []\nn = 2\nwhile len(ps) < 1000:\n"
        "    if all(n % p for p in ps if p * p <= n):\n        ps.append(n)\n    n += 1\n"
        "print(ps[-1])",
    ),
    _number(
        "digit-sum-2-1000",
        "What is the sum of the decimal digits of 2**1000?",
        1366,
        "print(sum(map(int, str(2 ** 1000))))",
    ),
    _number(
        "factorial-zeros",
        "How many trailing zeros does 100! (100 factorial) have?",
        24,
        "import math\ns = str(math.factorial(100))\nprint(len(s) - len(s.rstrip('0')))",
    ),
    _number(
        "collatz-27",
        "How many steps does the Collatz sequence starting at 27 take to reach 1 (n -> n/2 if even, 3n+1 if odd)?",
        111,
        "n, k = 27, 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n    k += 1\nprint(k)",
    ),
    _number(
        "palindrome-product",
        "What is the largest palindrome that is a product of two 2-digit numbers?",
        9009,
        "print(max(a * b for a in range(10, 100) for b in range(10, 100) if str(a * b) == str(a * b)[::-1]))",
    ),
    _number(
        "gcd-lcm",
        "What is the least common multiple of the numbers 1 to 20?",
        232792560,
        "import math\nprint(math.lcm(*range(1, 21)))",
    ),
    _number(
        "pythagorean-1000",
        "There is one Pythagorean triple a < b < c with a + b + c = 1000. What is a * b * c?",
        31875000,
        "print(next(a * b * (1000 - a - b) for a in range(1, 1000) for b in range(a + 1, 1000)"
        " if a * a + b * b == (1000 - a - b) ** 2))",
    ),
    _number(
        "divisor-count",
        "How many positive divisors does 720 have?",
        30,
        "print(sum(720 % d == 0 for d in range(1, 721)))",
    ),
    _number(
        "sqrt-2",
        "What is the square root of 2, to 6 decimal places?",
        1.414214,
        "print(round(2 ** 0.5, 6))",
        tolerance=5e-7,
    ),
    _number(
        "compound-interest",
        "100 is invested at 5% interest compounded yearly. What is it worth after 10 years, to 2 decimal places?",
        162.89,
        "print(round(100 * 1.05 ** 10, 2))",
        tolerance=0.005,
    ),
    _number(
        "binomial",
        "How many ways are there to choose 6 items out of 49?",
        13983816,
        "import math\nprint(math.comb(49, 6))",
    ),
    _number(
        "count-primes-10000",
        "How many primes are there below 10000?",
        1229,
        "print(sum(all(n % d for d in range(2, int(n ** 0.5) + 1)) for n in range(2, 10000)))",
    ),
    _number("power-mod", "What is 3**200 mod 1000003?", pow(3, 200, 1000003), "print(pow(3, 200, 1000003))"),
    _number(
        "harmonic-100",
        "What is the 100th harmonic number 1 + 1/2 + ... + 1/100, to 4 decimal places?",
        5.1874,
        "print(round(sum(1 / k for k in range(1, 101)), 4))",
        tolerance=5e-5,
    ),
    _function(
        "reverse-words",
        "Write `reverse_words(s)`: the words of the string `s` (split on whitespace) in reverse "
        "order, joined by single spaces.",
        "reverse_words",
        [(("hello world",), "world hello"), ((" a  b c ",), "c b a"), (("",), "")],
        "def reverse_words(s):\n    return ' '.join(reversed(s.split()))",
    ),
    _function(
        "is-palindrome",
        "Write `is_palindrome(s)`: True if `s` reads the same backwards, ignoring case and "
        "every character that is not a letter or a digit.",
        "is_palindrome",
        [(("A man, a plan, a canal: Panama",), True), (("race a car",), False), (("",), True), (("ab2ba",), True)],
        "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]",
    ),
    _function(
        "fizzbuzz",
        "Write `fizzbuzz(n)`: the list of strings for 1..n, 'Fizz' for multiples of 3, 'Buzz' of 5, "
        "'FizzBuzz' of both, else the number.",
        "fizzbuzz",
        [
            ((5,), ["1", "2", "Fizz", "4", "Buzz"]),
            ((0,), []),
            (
                (15,),
                [str(i) if i % 3 and i % 5 else "Fizz" * (i % 3 == 0) + "Buzz" * (i % 5 == 0) for i in range(1, 16)],
            ),
        ],
        "def fizzbuzz(n):\n    return [str(i) if i % 3 and i % 5 else 'Fizz' * (i % 3 == 0) + 'Buzz' * (i % 5 == 0)"
        " for i in range(1, n + 1)]",
    ),
    _function(
        "flatten",
        "Write `flatten(xs)`: the list of every non-list item of the nested lists `xs`, in order.",
        "flatten",
        [(([1, [2, [3, 4]], 5],), [1, 2, 3, 4, 5]), (([],), []), (([[[]], ["a"]],), ["a"])],
        "def flatten(xs):\n    out = []\n    for x in xs:\n"
        "        out.extend(flatten(x) if isinstance(x, list) else [x])\n"
        "    return out",
    ),
    _function(
        "run-length",
        "Write `run_length(s)`: the run-length encoding of `s`, each run as the character then its "
        "count, e.g. 'aaab' -> 'a3b1'.",
        "run_length",
        [(("aaab",), "a3b1"), (("",), ""), (("abc",), "a1b1c1"), (("zzzzzzzzzzzz",), "z12")],
        "import itertools\ndef run_length(s):\n"
        "    return ''.join(f'{c}{len(list(g))}' for c, g in itertools.groupby(s))",
    ),
    _function(
        "anagrams",
        "Write `are_anagrams(a, b)`: True if `a` and `b` have the same letters, ignoring case and spaces.",
        "are_anagrams",
        [(("Listen", "Silent"), True), (("dormitory", "dirty room"), True), (("abc", "abd"), False)],
        "def are_anagrams(a, b):\n    key = lambda s: sorted(s.lower().replace(' ', ''))\n    return key(a) == key(b)",
    ),
    _function(
        "balanced",
        "Write `balanced(s)`: True if the brackets ()[]{} in `s` are balanced and properly nested "
        "(other characters are ignored).",
        "balanced",
        [(("([]{})",), True), (("([)]",), False), (("((",), False), (("a(b)c",), True), (("",), True)],
        "def balanced(s):\n    stack, pairs = [], {')': '(', ']': '[', '}': '{'}\n    for c in s:\n"
        "        if c in '([{':\n            stack.append(c)\n        elif c in pairs:\n"
        "            if not stack or stack.pop() != pairs[c]:\n                return False\n    return not stack",
    ),
    _function(
        "second-largest",
        "Write `second_largest(xs)`: the second largest distinct value of the list `xs`, or None when there is none.",
        "second_largest",
        [(([3, 1, 4, 1, 5],), 4), (([2, 2],), None), (([7],), None), (([-1, -2, -3],), -2)],
        "def second_largest(xs):\n    d = sorted(set(xs))\n    return d[-2] if len(d) > 1 else None",
    ),
    _function(
        "roman",
        "Write `to_roman(n)`: the Roman numeral of 1 <= n <= 3999, e.g. 1994 -> 'MCMXCIV'.",
        "to_roman",
        [((1994,), "MCMXCIV"), ((4,), "IV"), ((3999,), "MMMCMXCIX"), ((58,), "LVIII")],
        "def to_roman(n):\n    out = ''\n"
        "    for v, s in ((1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'),"
        " (90, 'XC'), (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')):\n"
        "        while n >= v:\n            out, n = out + s, n - v\n    return out",
    ),
    _function(
        "binary-search",
        "Write `index_of(xs, x)`: the index of `x` in the sorted list `xs`, or -1, in O(log n).",
        "index_of",
        [(([1, 3, 5, 7, 9], 7), 3), (([1, 3, 5], 4), -1), (([], 1), -1), (([2], 2), 0)],
        "import bisect\ndef index_of(xs, x):\n    i = bisect.bisect_left(xs, x)\n"
        "    return i if i < len(xs) and xs[i] == x else -1",
    ),
    _function(
        "word-count",
        "Write `top_word(text)`: the most frequent lower-cased word of `text` (words are runs of "
        "letters), the alphabetically first on a tie.",
        "top_word",
        [(("the cat and the hat",), "the"), (("b a B A c",), "a"), (("Hello, hello! World.",), "hello")],
        "import collections, re\ndef top_word(text):\n"
        "    counts = collections.Counter(re.findall('[a-z]+', text.lower()))\n"
        "    return min(counts, key=lambda w: (-counts[w], w))",
    ),
    _function(
        "primes-upto",
        "Write `primes_upto(n)`: the sorted list of primes <= n.",
        "primes_upto",
        [((10,), [2, 3, 5, 7]), ((1,), []), ((2,), [2]), ((30,), [2, 3, 5, 7, 11, 13, 17, 19, 23, 29])],
        "def primes_upto(n):\n"
        "    return [k for k in range(2, n + 1) if all(k % d for d in range(2, int(k ** 0.5) + 1))]",
    ),
    _function(
        "merge-intervals",
        "Write `merge(intervals)`: the list of [start, end] intervals merged where they "
        "overlap or touch, sorted by start.",
        "merge",
        [(([[1, 3], [2, 6], [8, 10]],), [[1, 6], [8, 10]]), (([[1, 4], [4, 5]],), [[1, 5]]), (([],), [])],
        "def merge(intervals):\n    out = []\n    for s, e in sorted(intervals):\n"
        "        if out and s <= out[-1][1]:\n            out[-1][1] = max(out[-1][1], e)\n"
        "        else:\n            out.append([s, e])\n    return out",
    ),
    _function(
        "caesar",
        "Write `caesar(s, k)`: `s` with every ASCII letter shifted k places in the alphabet "
        "(wrapping around, case kept), other characters unchanged.",
        "caesar",
        [(("abc xyz", 3), "def abc"), (("Hello, World!", 13), "Uryyb, Jbeyq!"), (("a", -1), "z")],
        "def caesar(s, k):\n    def shift(c):\n        if c.isascii() and c.isalpha():\n"
        "            base = ord('a') if c.islower() else ord('A')\n"
        "            return chr((ord(c) - base + k) % 26 + base)\n"
        "        return c\n    return ''.join(map(shift, s))",
    ),
    _function(
        "digits-sum",
        "Write `digital_root(n)`: repeatedly sum the decimal digits of n >= 0 until one digit is left, and return it.",
        "digital_root",
        [((942,), 6), ((0,), 0), ((999999999999,), 9), ((10,), 1)],
        "def digital_root(n):\n    while n >= 10:\n        n = sum(map(int, str(n)))\n    return n",
    ),
)

TASKS_BY_ID = {task.id: task for task in TASKS}
