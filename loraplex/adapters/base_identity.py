"""What base model an adapter is for: its id, an immutable revision, and its vocabulary's hash.

An adapter's weights mean something only on top of the exact base they were trained on, and its
token ids only under that base's vocabulary. The served base is identified by

    revision    "sha256:<hex>" over config.json and every weights file (name, size, bytes), in
                order; computed once at startup and cached by the files' stat (path, size,
                mtime_ns) so a restart does not read multi-GB weights again. A model built in
                process (a bench's random model) has no files: it carries a declared revision,
                "declared:<text>", which is the caller's word, not a hash.
    vocab_hash  sha256 over the vocabulary in tokenizer.json (token -> id, added tokens included),
                or None when the base ships no tokenizer.json

Both go into every adapter's manifest and revision (`revision.py`); the model id (a directory
name) goes into the manifest only, since it says where the base was found, not what it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.config import ModelConfig

TOKENIZER_JSON = "tokenizer.json"
# Files of a tokenizer that carry a vocabulary; an adapter shipping any of them must ship
# tokenizer.json, the one whose vocabulary is compared with the base's.
TOKENIZER_FILES = (
    TOKENIZER_JSON,
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
)
# Beside an adapter's PEFT files: {"base_revision": "<the base revision it was trained on>"}.
BASE_FILE = "loraplex.json"
_CHUNK = 1 << 22


@dataclass(frozen=True)
class BaseIdentity:
    model_id: str  # the base's name (its directory's name, or what the caller declared)
    revision: str  # "sha256:<hex>" of config and weights, or "declared:<text>"
    vocab_hash: str | None  # sha256 of the vocabulary; None: the base has no tokenizer.json

    def manifest_fields(self) -> dict[str, Any]:
        return {
            "base_model_id": self.model_id,
            "base_revision": self.revision,
            "tokenizer_hash": self.vocab_hash,
        }


def declared_identity(model_id: str, revision: str) -> BaseIdentity:
    """The identity of a model built in process: `revision` is whatever the caller declares (a
    seed and a config, say), prefixed so it can never pass for a hash of files."""
    if not isinstance(revision, str) or not revision or len(revision) > 256:
        raise ValueError(f"a declared base revision must be a non-empty string (<= 256), got {revision!r}")
    text = revision if revision.startswith("declared:") else f"declared:{revision}"
    return BaseIdentity(model_id, text, None)


def config_revision(config: ModelConfig) -> str:
    """A declared revision for an in-process model whose caller declared none: its config's hash
    (random weights of one config all pass for one base; only a declaration tells them apart)."""
    text = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return f"config-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def base_files(model_dir: Path) -> list[Path]:
    """config.json and the weights files the loader reads, in the order they are hashed."""
    from loraplex.model.loader import checkpoint_files  # torch and the model code, only when hashing

    return [model_dir / "config.json", *checkpoint_files(model_dir)]


def directory_identity(
    model_dir: str | Path,
    cache_file: Path | None = None,
    hasher: Callable[[Iterable[Path]], str] | None = None,
) -> BaseIdentity:
    """The identity of the model directory `model_dir`. `cache_file`: a JSON file that remembers
    the revision of files whose (path, size, mtime_ns) have not changed; None: always hash.
    `hasher`: computes the revision from the files (tests count its calls)."""
    root = Path(model_dir).resolve()
    files = base_files(root)
    stats = [[str(p), st.st_size, st.st_mtime_ns] for p in files for st in [p.stat()]]
    cache = _read_cache(cache_file)
    entry = cache.get(str(root))
    if isinstance(entry, dict) and entry.get("stats") == stats and isinstance(entry.get("revision"), str):
        revision: str = entry["revision"]
    else:
        revision = (hasher or hash_files)(files)
        if cache_file is not None:
            cache[str(root)] = {"stats": stats, "revision": revision}
            _write_cache(cache_file, cache)
    vocab = None
    if (root / TOKENIZER_JSON).is_file():
        try:
            vocab = tokenizer_vocab_hash(root / TOKENIZER_JSON)
        except ValueError:
            # an unreadable vocabulary must not stop the server; with none to compare against,
            # every adapter that ships a tokenizer is refused
            vocab = None
    return BaseIdentity(root.name, revision, vocab)


def hash_files(files: Iterable[Path]) -> str:
    """The revision "sha256:<hex>" over each file's name, size and bytes (the framing keeps two
    file lists with the same concatenated bytes apart)."""
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def tokenizer_vocab_hash(path: Path, max_bytes: int = 64 << 20) -> str:
    """sha256 of the vocabulary in a tokenizer.json: [id, token] pairs of the model's vocabulary
    and the added tokens, sorted by id. Merges, normalizers and scores are left out: they change
    how text splits, not which id means which token. Raises ValueError naming what is wrong."""
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{path.name} is {size} bytes, more than the limit of {max_bytes}")
    try:
        raw = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path.name} is not valid JSON: {err}") from None
    model = raw.get("model") if isinstance(raw, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    pairs: set[tuple[int, str]] = set()
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        pairs = {(int(i), str(t)) for t, i in vocab.items() if isinstance(i, int)}
    elif isinstance(vocab, list):  # Unigram: [token, score] in id order
        pairs = {(i, str(e[0])) for i, e in enumerate(vocab) if isinstance(e, list) and e}
    else:
        raise ValueError(f"{path.name} has no model vocabulary")
    for added in raw.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            pairs.add((added["id"], str(added.get("content"))))
    text = json.dumps(sorted(pairs), separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def check_adapter_base(directory: Path, base: BaseIdentity) -> None:
    """Refuse (ValueError naming the reason) an adapter in `directory` that records another base
    revision (in loraplex.json) or ships a tokenizer whose vocabulary is not the base's."""
    recorded = directory / BASE_FILE
    if recorded.is_file():
        try:
            meta = json.loads(recorded.read_bytes()) if recorded.stat().st_size <= 64 << 10 else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            meta = None
        if (
            not isinstance(meta, dict)
            or set(meta) != {"base_revision"}
            or not isinstance(meta["base_revision"], str)
        ):
            raise ValueError(f'{BASE_FILE} must be a JSON object {{"base_revision": "<revision>"}}')
        if meta["base_revision"] != base.revision:
            raise ValueError(
                f"base model mismatch: the adapter was made for base revision {meta['base_revision']!r}, "
                f"this server serves {base.model_id!r} at base revision {base.revision!r}"
            )
    shipped = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    if not shipped:
        return
    if TOKENIZER_JSON not in shipped:
        raise ValueError(
            f"tokenizer mismatch cannot be ruled out: the adapter ships {', '.join(shipped)} but no "
            f"{TOKENIZER_JSON} to compare vocabularies with"
        )
    if base.vocab_hash is None:
        raise ValueError(
            f"tokenizer mismatch: the adapter ships a tokenizer but the base model {base.model_id!r} has none"
        )
    vocab = tokenizer_vocab_hash(directory / TOKENIZER_JSON)
    if vocab != base.vocab_hash:
        raise ValueError(
            f"tokenizer mismatch: the adapter's {TOKENIZER_JSON} has vocabulary hash {vocab[:16]}..., "
            f"the base model's is {base.vocab_hash[:16]}..."
        )


def _read_cache(cache_file: Path | None) -> dict[str, Any]:
    if cache_file is None or not cache_file.is_file():
        return {}
    try:
        data = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache only costs one rehash
    return data if isinstance(data, dict) else {}


def _write_cache(cache_file: Path, cache: dict[str, Any]) -> None:
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=".tmp-", dir=cache_file.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f)
        os.replace(temp, cache_file)
    finally:
        Path(temp).unlink(missing_ok=True)
