"""The checks of the returned Samples themselves: shape, statuses, ids, prompts and labels from slime's
Dataset, token / mask / log-prob lengths, prompt tokens and image tokens as slime's processor makes them,
and (with the scripted server) the loss mask on exactly the model's tokens."""

from __future__ import annotations

from collections import Counter
from typing import Any

from scripts.slime_train_path.common import Checks, counts, problem_of


class SampleChecks(Checks):
    def shape(self, name: str, out: Any, groups: Any) -> None:
        args, s = self.run.args, self.s
        sizes = [len(g) for g in groups] if isinstance(groups, list) else []
        is_output = isinstance(out, s.RolloutFnTrainOutput)
        self.ok(
            f"{name}: output shape",
            is_output and len(sizes) == args.rollout_batch_size and all(n == args.n_samples_per_prompt for n in sizes),
            f"{type(out).__name__} (slime's RolloutFnTrainOutput: {is_output}), {len(sizes)} groups of {sizes} "
            f"vs rollout_batch_size {args.rollout_batch_size} x n_samples_per_prompt {args.n_samples_per_prompt}",
        )
        try:
            s.validate_rollout_id_annotated(groups)
            self.ok(f"{name}: slime's validate_rollout_id_annotated", True, "on the nested output as returned")
        except Exception as exc:
            self.report.error(self.run.name, f"{name}: slime's validate_rollout_id_annotated", exc)
        flat = [x for g in groups for x in g] if sizes else []
        self.ok(
            f"{name}: samples are slime's Sample",
            bool(flat) and all(isinstance(x, s.Sample) for x in flat),
            f"types {counts(type(x).__module__ + '.' + type(x).__name__ for x in flat)}",
        )

    def samples(self, name: str, groups: list[list[Any]], flat: list[Any], rollout_id: int) -> None:
        run, s = self.run, self.s
        Status = s.Sample.Status
        statuses = [x.status for x in flat]
        bad = [
            x
            for x in flat
            if x.status == Status.PENDING or (x.status in (Status.ABORTED, Status.FAILED) and not x.remove_sample)
        ]
        self.ok(
            f"{name}: statuses",
            not bad,
            f"{counts(getattr(st, 'value', st) for st in statuses)}; remove_sample on "
            f"{sum(bool(x.remove_sample) for x in flat)}; pending or unremoved aborted/failed: {len(bad)}",
        )

        indices = [x.index for x in flat]
        per_group = [sorted({str(x.group_index) for x in g}) for g in groups]
        whole = all(len(g) == 1 for g in per_group) and len({g[0] for g in per_group}) == len(per_group)
        self.ok(
            f"{name}: group_index and index as slime's data source set them",
            None not in indices and len(set(indices)) == len(indices) and whole,
            f"{len(set(indices))} distinct indices over {len(flat)} samples; group_index per returned group "
            f"{per_group}",
        )

        ids = [x.rollout_id for x in flat]
        given = [i for i in ids if i is not None]
        shared = {i: n for i, n in Counter(given).items() if n > 1}
        self.ok(
            f"{name}: rollout_id per trajectory (or None)",
            not shared,
            f"rollout_ids {counts(ids)} over {len(flat)} samples (one trajectory each); step id {rollout_id}; "
            f"ids shared by several trajectories: {shared or 'none'}",
        )

        rendered = run.rendered
        wrong_prompt = [x.index for x in flat if rendered.get(problem_of(x), (None,))[0] != x.prompt]
        wrong_label = [x.index for x in flat if rendered.get(problem_of(x), (None, None))[1] != x.label]
        self.ok(
            f"{name}: prompts are slime Dataset's rendered text",
            not wrong_prompt,
            f"{len(flat) - len(wrong_prompt)}/{len(flat)} equal the --apply-chat-template text of their row "
            f"(prompt types {counts(type(x.prompt).__name__ for x in flat)})",
        )
        self.ok(
            f"{name}: labels kept", not wrong_label, f"{len(flat) - len(wrong_label)}/{len(flat)} equal their row's"
        )

        def lengths_ok(x: Any) -> bool:
            n = x.response_length
            return (
                0 < n < len(x.tokens)
                and x.loss_mask is not None
                and len(x.loss_mask) == n
                and x.rollout_log_probs is not None
                and len(x.rollout_log_probs) == n
            )

        budget = getattr(self.run.args, "rollout_max_response_len", None)
        broken = [x.index for x in flat if not lengths_ok(x) or (budget is not None and x.response_length > budget)]
        self.ok(
            f"{name}: tokens, loss_mask, rollout_log_probs lengths",
            not broken,
            f"{len(flat) - len(broken)}/{len(flat)} with 0 < response_length < len(tokens) == prompt + response "
            f"and len(loss_mask) == len(rollout_log_probs) == response_length <= rollout_max_response_len "
            f"{budget} (longest {max(x.response_length for x in flat)}); trained tokens "
            f"{sum(sum(x.loss_mask or []) for x in flat)} of {sum(x.response_length for x in flat)}",
        )

        self.prompt_tokens(name, flat)
        self.images(name, flat)
        if run.server is not None:
            self.token_exact(name, flat)
        decoded = [
            x.index for x in flat if x.response != run.tokenizer.decode(x.tokens[len(x.tokens) - x.response_length :])
        ]
        self.ok(
            f"{name}: response is the decoded response tokens",
            not decoded,
            f"{len(flat) - len(decoded)}/{len(flat)} (the reward model reads sample.response)",
        )

    def prompt_tokens(self, name: str, flat: list[Any]) -> None:
        """The prompt part of `tokens` is what slime's own rollout sends for this prompt and its images
        (`_prepare_prompt_ids`: the processor on the text and `build_processor_kwargs(multimodal_inputs)`)."""
        proc, s = self.run.processor, self.s
        mismatched = []
        for x in flat:
            try:
                ids = list(proc(text=x.prompt, **s.build_processor_kwargs(x.multimodal_inputs))["input_ids"][0])
            except Exception as exc:
                self.report.error(self.run.name, f"{name}: prompt tokens", exc)
                return
            if list(x.tokens[: len(x.tokens) - x.response_length]) != ids:
                mismatched.append(x.index)
        self.ok(
            f"{name}: prompt tokens == slime's processor(prompt, images)",
            not mismatched,
            f"{len(flat) - len(mismatched)}/{len(flat)} equal; multimodal_inputs keys "
            f"{counts(tuple(sorted((x.multimodal_inputs or {}).keys())) for x in flat)}",
        )

    def token_exact(self, name: str, flat: list[Any]) -> None:
        """With the scripted server the model's tokens are known: every loss-mask-1 run of the response is
        one reply of the server, with its log-probs (-0.1, -0.2, ...); the env's tokens have mask 0 and
        log-prob 0.0 (what slime's trainer and its off-policy correction read)."""
        replies = {text for _, _, text in self.run.server.replies}
        bad = []
        for x in flat:
            mask, logprobs = x.loss_mask or [], x.rollout_log_probs or []
            response = x.tokens[len(x.tokens) - x.response_length :]
            runs, start = [], 0
            for i in range(1, len(mask) + 1):
                if i == len(mask) or mask[i] != mask[start]:
                    runs.append((mask[start], start, i))
                    start = i
            for bit, a, b in runs:
                if bit == 1:
                    text = self.run.tokenizer.decode(response[a:b]).removesuffix("<|im_end|>")
                    want = [-0.1 * (k + 1) for k in range(b - a)]
                    got = logprobs[a:b]
                    if (
                        text not in replies
                        or len(got) != len(want)
                        or any(abs(p - q) > 1e-6 for p, q in zip(got, want, strict=True))
                    ):
                        bad.append((x.index, "model run", text[:40]))
                        break
                elif any(p != 0.0 for p in logprobs[a:b]):
                    bad.append((x.index, "env run with non-zero log-probs", b - a))
                    break
            else:
                if not any(bit == 1 for bit, _, _ in runs):
                    bad.append((x.index, "no model tokens", 0))
        turns = Counter(
            sum(1 for i in range(len(x.loss_mask or [])) if x.loss_mask[i] == 1 and (i == 0 or x.loss_mask[i - 1] == 0))
            for x in flat
        )
        ends = sum(bool(x.loss_mask) and x.loss_mask[-1] == 1 for x in flat)
        self.ok(
            f"{name}: loss mask 1 exactly on the server's tokens, with its log-probs",
            not bad,
            f"{len(flat) - len(bad)}/{len(flat)}; model turns per sample {dict(turns)}; ending with a model turn "
            f"(as slime's geo3k rollout: no observation after the last step) {ends}/{len(flat)}; first problem: "
            f"{bad[0] if bad else 'none'}",
        )

    def images(self, name: str, flat: list[Any]) -> None:
        """What Qwen2.5-VL's forward asserts in training: image pad tokens == pixel grid / merge^2."""
        proc = self.run.processor
        pad = self.run.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        merge = getattr(proc.image_processor, "merge_size", 2)
        bad = []
        for x in flat:
            inputs = x.multimodal_train_inputs or {}
            grid = inputs.get("image_grid_thw")
            pixels = inputs.get("pixel_values")
            pads = sum(t == pad for t in x.tokens)
            if grid is None or pixels is None:
                bad.append((x.index, pads, None))
                continue
            patches = int(grid.prod(-1).sum())
            if pads != patches // (merge * merge) or pixels.shape[0] != patches:
                bad.append((x.index, pads, patches // (merge * merge)))
        self.ok(
            f"{name}: image tokens match multimodal_train_inputs",
            not bad,
            f"{len(flat) - len(bad)}/{len(flat)} with <|image_pad|> count == image_grid_thw patches / "
            f"{merge * merge} == pixel_values rows / {merge * merge}; first mismatch (index, pads, grid): "
            f"{bad[0] if bad else 'none'}",
        )

    # -- rewards ---------------------------------------------------------------------------------
