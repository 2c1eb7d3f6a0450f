"""The demo's string tasks, their prompt format, the fixed held-out split and an exact checker.

Inputs are 1 to 16 characters from `[a-z ]`. A prompt is the input followed by `=`; the answer
is the task applied to the input, followed by the EOS token `</s>`. The base model copies; each
adapter turns the same untagged prompt into its own task. During pretraining a one-letter tag
(`"R:abc="`) asks the base model for a task, so an adapter only has to switch the task on.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

ALPHABET = "abcdefghijklmnopqrstuvwxyz "
MIN_LEN, MAX_LEN = 1, 16
PROMPT_END = "="
EOS = "</s>"


def _caesar(text: str) -> str:
    return "".join(c if c == " " else chr((ord(c) - 97 + 3) % 26 + 97) for c in text)


TASKS: dict[str, Callable[[str], str]] = {
    "copy": lambda s: s,
    "reverse": lambda s: s[::-1],
    "upper": str.upper,
    "sort": lambda s: "".join(sorted(s)),
    "caesar": _caesar,
}
ADAPTER_TASKS = ("reverse", "upper", "sort", "caesar")  # one shipped adapter per task
# Pretraining tags; copy is the untagged prompt, which is what the base model is served with.
TAGS = {"reverse": "R", "upper": "U", "sort": "S", "caesar": "C"}


def make_prompt(text: str, task: str | None = None) -> str:
    """The prompt for `text`: untagged (what is served), or tagged with a task (pretraining only)."""
    tag = TAGS.get(task or "copy")
    return f"{tag}:{text}{PROMPT_END}" if tag else f"{text}{PROMPT_END}"


def is_held_out(text: str) -> bool:
    """A tenth of all strings, fixed by their hash: never trained on, only evaluated."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % 10 == 0


def random_text(rng: random.Random, length: int, alphabet: str = ALPHABET) -> str:
    return "".join(rng.choice(alphabet) for _ in range(length))


def sample_train_text(rng: random.Random, length: int, repeat_rate: float = 0.0) -> str:
    """A random string outside the held-out bucket. With probability `repeat_rate` its characters
    come from a random 2-5 character subset: runs and repeats are where a model that finds
    positions by content slips, and uniform strings have too few of them."""
    alphabet = ALPHABET
    if rng.random() < repeat_rate:
        alphabet = "".join(rng.sample(ALPHABET, rng.randint(2, 5)))
    for attempt in range(1000):
        text = random_text(rng, length, alphabet if attempt < 100 else ALPHABET)
        if not is_held_out(text):
            return text
    raise AssertionError("a tenth of strings is held out; 1000 draws cannot all land there")


def held_out_inputs(n: int, seed: int = 1234) -> list[str]:
    """`n` distinct held-out strings in a fixed order for a given seed, lengths cycling through
    1..16; a short length whose held-out strings are used up is skipped from then on."""
    rng = random.Random(seed)
    # Lengths 1-3 have few strings (27, 729, 19683): draw those from a shuffled exhaustive list, so
    # they are neither repeated nor searched for at random.
    pools = {k: _held_out_of_length(k, rng) for k in range(MIN_LEN, 4)}
    out: list[str] = []
    seen: set[str] = set()
    for k in itertools.cycle(range(MIN_LEN, MAX_LEN + 1)):
        if len(out) == n:
            return out
        if k in pools:
            if not pools[k]:
                continue
            text = pools[k].pop()
        else:
            text = random_text(rng, k)
            while not is_held_out(text):
                text = random_text(rng, k)
        if text not in seen:
            seen.add(text)
            out.append(text)
    raise AssertionError("unreachable")


def _held_out_of_length(k: int, rng: random.Random) -> list[str]:
    texts = [""]
    for _ in range(k):
        texts = [t + c for t in texts for c in ALPHABET]
    pool = [t for t in texts if is_held_out(t)]
    rng.shuffle(pool)
    return pool


@dataclass
class TaskScore:
    """Exact-match accuracy of one model on one task, and how often it gave another task's answer.

    `confusion[other]` counts only inputs where `other`'s answer differs from this task's answer.
    """

    task: str
    total: int
    correct: int
    confusion: dict[str, float] = field(default_factory=dict)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (input, output), first few

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0

    @property
    def worst_confusion(self) -> float:
        return max(self.confusion.values(), default=0.0)


def score(task: str, inputs: Sequence[str], outputs: Sequence[str]) -> TaskScore:
    """Compare generated completions (EOS stripped) with every task's answer."""
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
    want = TASKS[task]
    correct = 0
    failures: list[tuple[str, str]] = []
    confusion: dict[str, float] = {}
    for x, y in zip(inputs, outputs, strict=True):
        if y == want(x):
            correct += 1
        elif len(failures) < 10:
            failures.append((x, y))
    for other, fn in TASKS.items():
        if other == task:
            continue
        differing = [(x, y) for x, y in zip(inputs, outputs, strict=True) if fn(x) != want(x)]
        hits = sum(y == fn(x) for x, y in differing)
        confusion[other] = hits / len(differing) if differing else 0.0
    return TaskScore(task, len(inputs), correct, confusion, failures)


def evaluate(generate_fn: Callable[[list[str]], list[str]], task: str, inputs: Sequence[str]) -> TaskScore:
    """Score `generate_fn` (untagged prompts -> completions without EOS) on `task` over `inputs`."""
    prompts = [make_prompt(x) for x in inputs]
    return score(task, inputs, list(generate_fn(prompts)))


def format_table(scores: dict[str, TaskScore]) -> str:
    """Markdown table: one row per model, one column per task; the cell is the share of outputs equal
    to that task's answer (the row's own task: accuracy; others: over inputs where answers differ)."""
    header = "| model | n | " + " | ".join(TASKS) + " |"
    lines = [header, "|" + " --- |" * (len(TASKS) + 2)]
    for label, s in scores.items():
        cells = [
            f"**{100 * s.accuracy:.2f}**" if t == s.task else f"{100 * s.confusion[t]:.2f}" for t in TASKS
        ]
        lines.append(f"| {label} | {s.total} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
