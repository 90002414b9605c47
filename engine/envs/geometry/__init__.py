"""Built-in env `geometry`: drawn geometry problems for a VLM (or described in words for a text model),
graded by a math-answer rule, with hint images in the feedback.

    rows = make_prompts(8, seed=0, vision=True)     # {"prompt": [...], "label": "5\\sqrt{2}", "metadata": {...}}
    env = build_env(EnvSample.from_row(rows[0]))    # or `turnstile run --env geometry --vision`

problems.py draws and solves the problems, drawing.py renders them, grader.py reads and grades answers
(slime's `--rm-type math` rule where slime imports), env.py is the env. docs/envs/geometry.md tells more.
"""

from engine.envs.geometry.env import GeometryEnv, build_env, make_prompts, prompt_row

__all__ = ["GeometryEnv", "build_env", "make_prompts", "prompt_row"]
