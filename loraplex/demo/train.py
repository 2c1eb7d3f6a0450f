"""Train the demo model and its task adapters: `python -m loraplex.demo.train [--out DIR] [--quick]`.

Step 1 pretrains a small Llama on a multitask mixture: the untagged prompt `"abc="` means copy and
tagged prompts (`"R:abc="`, `"U:..."`, `"S:..."`, `"C:..."`) teach every other task. Step 2 trains
one PEFT LoRA adapter per task on the frozen base, on the untagged prompt only, so the adapter's
job is to switch its task on. Everything is seeded; strings in the held-out bucket
(`tasks.is_held_out`) are never trained on and are what accuracy and confusion are measured on.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from loraplex.demo import tasks
from loraplex.demo.char_tokenizer import VOCAB_SIZE, build_char_tokenizer, save_demo_tokenizer

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
DEFAULT_OUT = Path(__file__).parent / "assets"
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    task: str
    rank: int
    alpha: int
    targets: tuple[str, ...]


# Ranks, scales and target sets differ on purpose, so serving the four together mixes them.
ADAPTERS = (
    AdapterSpec("reverse", 16, 32, ATTN + MLP),
    AdapterSpec("upper", 8, 16, ("q_proj", "v_proj", "o_proj")),
    AdapterSpec("sort", 12, 24, ATTN + MLP),
    AdapterSpec("caesar", 8, 8, MLP),
)
# Harder tasks get more of the pretraining mixture.
TASK_WEIGHTS = {"copy": 1.0, "reverse": 1.5, "upper": 1.0, "sort": 2.0, "caesar": 1.0}


@dataclass(frozen=True)
class Schedule:
    base_steps: int = 8000
    base_batch: int = 64
    base_lr: float = 2e-3
    adapter_steps: int = 800
    adapter_batch: int = 64
    adapter_lr: float = 3e-3
    warmup: int = 200
    repeat_rate: float = 0.25  # share of training strings drawn from a 2-5 character subset
    eval_every: int = 1000
    eval_n: int = 64  # held-out inputs per task for the progress lines
    final_eval_n: int = 1000  # held-out inputs per model for the final table


QUICK = Schedule(base_steps=300, adapter_steps=60, eval_every=150, eval_n=32, final_eval_n=64)


def model_config():  # noqa: ANN201 (transformers.LlamaConfig)
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, so the demo exercises it
        max_position_embeddings=64,  # the longest sequence, "R:" + 16 + "=" + 16 + "</s>", is 36
        rms_norm_eps=1e-5,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )


_TOKENIZER = build_char_tokenizer()


def encode(text: str) -> list[int]:
    return _TOKENIZER.encode(text)  # one id per character, no BOS: exactly what the engine sends


def make_batch(
    rng: random.Random, mixture: dict[str, float], batch_size: int, tagged: bool, repeat_rate: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of a single input length (so nothing is padded but the 2-token tag). Labels are
    -100 on the prompt: only the answer and EOS are learnt."""
    length = rng.choices(range(tasks.MIN_LEN, tasks.MAX_LEN + 1), weights=[k + 4 for k in range(1, 17)])[0]
    names = list(mixture)
    rows: list[tuple[list[int], int]] = []
    for task in rng.choices(names, weights=[mixture[t] for t in names], k=batch_size):
        text = tasks.sample_train_text(rng, length, repeat_rate)
        prompt = encode(tasks.make_prompt(text, task if tagged else None))
        rows.append((prompt + encode(tasks.TASKS[task](text)) + [EOS_ID], len(prompt)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((batch_size, width), PAD_ID, dtype=torch.long)
    labels = torch.full((batch_size, width), -100, dtype=torch.long)
    for i, (ids, prompt_len) in enumerate(rows):
        # Padding sits after EOS, where causal attention keeps it from every learnt position.
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
    return input_ids, labels


@torch.no_grad()
def greedy(model, prompts: Sequence[str], max_new: int = tasks.MAX_LEN + 1) -> list[str]:  # noqa: ANN001
    """Greedy completions (text before EOS), one `generate` per prompt length so no row is padded."""
    was_training = model.training
    model.eval()
    encoded = [encode(p) for p in prompts]
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    out = [""] * len(prompts)
    for idxs in by_len.values():
        batch = torch.tensor([encoded[i] for i in idxs])
        gen = model.generate(
            input_ids=batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )
        for row, i in zip(gen[:, batch.shape[1] :].tolist(), idxs, strict=True):
            tokens = row[: row.index(EOS_ID)] if EOS_ID in row else row
            out[i] = _TOKENIZER.decode(tokens, skip_special_tokens=True)
    model.train(was_training)
    return out


def tagged_accuracy(model, inputs: Sequence[str]) -> dict[str, float]:  # noqa: ANN001
    """Pretraining progress: every task through its tag (copy untagged)."""
    result = {}
    for task, fn in tasks.TASKS.items():
        outs = greedy(model, [tasks.make_prompt(x, task) for x in inputs])
        result[task] = sum(y == fn(x) for x, y in zip(inputs, outs, strict=True)) / len(inputs)
    return result


@dataclass(frozen=True)
class Phase:
    label: str
    steps: int
    batch: int
    lr: float
    mixture: dict[str, float]
    tagged: bool


def _lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine to 5% of peak


def train_loop(
    model,  # noqa: ANN001
    phase: Phase,
    schedule: Schedule,
    rng: random.Random,
    check: Callable[[], dict[str, float]],
) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=phase.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = min(schedule.warmup, phase.steps // 5)
    model.train()
    start, running = time.time(), 0.0
    for step in range(1, phase.steps + 1):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step - 1, phase.steps, phase.lr, warmup)
        input_ids, labels = make_batch(rng, phase.mixture, phase.batch, phase.tagged, schedule.repeat_rate)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += loss.item()
        if step % 100 == 0 or step == phase.steps:
            mean = running / (100 if step % 100 == 0 else step % 100)
            elapsed = time.time() - start
            print(f"[{phase.label}] step {step}/{phase.steps} loss {mean:.4f} ({elapsed:.0f}s)", flush=True)
            running = 0.0
        if step % schedule.eval_every == 0 or step == phase.steps:
            accs = " ".join(f"{k} {100 * v:.1f}%" for k, v in check().items())
            print(f"[{phase.label}] step {step} held-out exact match: {accs}", flush=True)


def pretrain_base(schedule: Schedule, seed: int):  # noqa: ANN201 (LlamaForCausalLM)
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(model_config())
    probe = tasks.held_out_inputs(schedule.eval_n, seed=seed + 1)
    phase = Phase("base", schedule.base_steps, schedule.base_batch, schedule.base_lr, TASK_WEIGHTS, True)
    train_loop(model, phase, schedule, random.Random(seed), lambda: tagged_accuracy(model, probe))
    return model.eval()


def train_adapter(base, spec: AdapterSpec, schedule: Schedule, seed: int):  # noqa: ANN001, ANN201
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0, bias="none"
    )
    model = get_peft_model(base, config)
    probe = tasks.held_out_inputs(schedule.eval_n, seed=seed + 1)
    phase = Phase(
        spec.task,
        schedule.adapter_steps,
        schedule.adapter_batch,
        schedule.adapter_lr,
        {spec.task: 1.0},
        False,
    )
    check = lambda: {spec.task: tasks.evaluate(lambda p: greedy(model, p), spec.task, probe).accuracy}
    train_loop(model, phase, schedule, random.Random(seed), check)
    return model.eval()


def save_model(model, out: Path) -> None:  # noqa: ANN001
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(out))
    # Tied head: lm_head.weight is the embedding, stored once (as transformers itself does).
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_demo_tokenizer(out, model.config.max_position_embeddings)


def save_adapter(model, out: Path) -> None:  # noqa: ANN001 (PeftModel)
    model.save_pretrained(str(out))
    (out / "README.md").unlink(missing_ok=True)  # PEFT's blank model card
    sort_target_modules(out / "adapter_config.json")


def sort_target_modules(path: Path) -> None:
    # PEFT writes target_modules from a set, in an order that changes from run to run; sorted, a
    # retrain writes byte-identical files.
    config = json.loads(path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def final_table(base, adapters: dict, n: int, seed: int) -> dict[str, tasks.TaskScore]:  # noqa: ANN001
    inputs = tasks.held_out_inputs(n, seed=seed)
    scores = {"base": tasks.evaluate(lambda p: greedy(base, p), "copy", inputs)}
    for name, model in adapters.items():
        scores[name] = tasks.evaluate(functools.partial(greedy, model), name, inputs)
    return scores


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loraplex.demo.train", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="writes OUT/model, OUT/adapters/<task>")
    parser.add_argument("--quick", action="store_true", help="a few hundred steps: checks the pipeline only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it)")
    parser.add_argument("--base-steps", type=int, help="override the schedule's pretraining steps")
    parser.add_argument("--adapter-steps", type=int, help="override the schedule's steps per adapter")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    schedule = QUICK if args.quick else Schedule()
    if args.base_steps is not None:
        schedule = replace(schedule, base_steps=args.base_steps)
    if args.adapter_steps is not None:
        schedule = replace(schedule, adapter_steps=args.adapter_steps)
    print(f"schedule: {json.dumps(asdict(schedule))}", flush=True)
    start = time.time()

    base = pretrain_base(schedule, args.seed)
    save_model(base, args.out / "model")
    base.requires_grad_(False)
    adapters = {}
    for i, spec in enumerate(ADAPTERS):
        model = train_adapter(copy.deepcopy(base), spec, schedule, args.seed + 100 * (i + 1))
        save_adapter(model, args.out / "adapters" / spec.task)
        adapters[spec.task] = model
    train_seconds = time.time() - start

    scores = final_table(base, adapters, schedule.final_eval_n, seed=args.seed + 7)
    print("\nheld-out exact match in percent: bold, the row's own task; other cells, how often the")
    print("row gave that task's answer, over the inputs where the two answers differ\n")
    print(tasks.format_table(scores))
    for label, s in scores.items():
        if s.failures:
            print(f"{label} failures (input, output): {s.failures[:5]}")
    print(f"\ntraining time: {train_seconds:.0f}s; total with evaluation: {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
