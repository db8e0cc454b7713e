"""Offline parallel corpora as ``datasets.DatasetDict`` objects with columns ``source``, ``target``, ``origin``.

Builders (all deterministic; the train/validation/test split of an example depends only on its own text, through
a hash, so adding or removing other examples never moves it):

- :func:`build_codegen_corpus` -- (docstring -> function source) pairs parsed with :mod:`ast` (never imported or
  executed) from every ``.py`` file under some source trees; default: this interpreter's standard library.
  ``direction="code2doc"`` gives the reverse (code summarisation) task.
- :func:`build_gettext_corpus` -- (msgid -> msgstr) pairs from the machine's gettext catalogs
  (``/usr/share/locale/<lang>/LC_MESSAGES/*.mo``), read with the stdlib :mod:`gettext` module.
- :func:`build_word_order_corpus` -- shuffled English sentences -> original order (InDIGO's word order recovery),
  from the English side of either corpus.
- :func:`load_parallel_files` -- the user's own TSV / CSV / JSONL files.
- :func:`load_hub_corpus` -- a ``datasets.load_dataset`` name (needs the Hub or a local dataset script/cache).

Built corpora are cached with ``save_to_disk`` under ``$FLEXFORMERS_CACHE`` (default ``~/.cache/flexformers``),
keyed by the builder's parameters and the size/mtime of every input file.
"""

from __future__ import annotations

import ast
import csv
import gettext
import hashlib
import json
import logging
import os
import random
import re
import shutil
import stat
import struct
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets

logger = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
TASKS = ("codegen", "code2doc", "translation", "word_order", "files", "hub")
_WHITESPACE = re.compile(r"\s+")


# --------------------------------------------------------------------------------------------------------------
# Deterministic split and caching
# --------------------------------------------------------------------------------------------------------------
def split_of(key: str, ratios: tuple[int, int, int] = (80, 10, 10)) -> str:
    """The split ("train"/"validation"/"test") of an example, from a SHA-256 hash of ``key`` (80/10/10 default)."""
    if len(ratios) != 3 or any(r < 0 for r in ratios) or sum(ratios) <= 0:
        raise ValueError(f"split ratios must be three non-negative numbers with a positive sum, got {ratios}")
    bucket = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") % sum(ratios)
    if bucket < ratios[0]:
        return "train"
    if bucket < ratios[0] + ratios[1]:
        return "validation"
    return "test"


def cache_root() -> Path:
    return Path(os.environ.get("FLEXFORMERS_CACHE", Path.home() / ".cache" / "flexformers")) / "corpora"


def _fingerprint(params: dict, files: Iterable[Path]) -> str:
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


def _cached(name: str, params: dict, files: list[Path], build, cache_dir: str | os.PathLike | None, use_cache: bool):
    """Load ``name`` from the cache when its fingerprint matches, else ``build()`` it and store it atomically."""
    if not use_cache:
        return build()
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / f"{name}-{_fingerprint(params, files)}"
    if (target / "dataset_dict.json").exists():
        logger.info("Loading cached corpus %s", target)
        return datasets.load_from_disk(str(target))
    corpus = build()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # "Saving the dataset" bars for a cache write are noise
    try:
        corpus.save_to_disk(str(staging), num_shards={split: 1 for split in corpus})  # 1 shard: empty splits reload
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
    try:
        os.replace(staging, target)  # atomic: concurrent ranks either win or find the finished copy
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return datasets.load_from_disk(str(target)) if (target / "dataset_dict.json").exists() else corpus


def _to_dataset_dict(rows: Iterable[dict], split_key, ratios) -> datasets.DatasetDict:
    buckets: dict[str, list[dict]] = {name: [] for name in SPLITS}
    for row in rows:
        buckets[split_of(split_key(row), ratios)].append(row)
    return datasets.DatasetDict({name: _dataset(rows) for name, rows in buckets.items()})


_FEATURES = datasets.Features(
    {"source": datasets.Value("string"), "target": datasets.Value("string"), "origin": datasets.Value("string")}
)


def _dataset(rows: list[dict]) -> datasets.Dataset:
    """A (possibly empty) dataset of source/target/origin rows."""
    columns = {name: [row[name] for row in rows] for name in _FEATURES}
    return datasets.Dataset.from_dict(columns, features=_FEATURES)


def _collapse(text: str) -> str:
    return _WHITESPACE.sub(" ", text).strip()


@dataclass
class SkipReport:
    """Counts of inputs a builder skipped, with the first few reasons (logged, and stored in ``info.description``)."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def add(self, reason: str, detail: str):
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.examples) < 20:
            self.examples.append(f"{reason}: {detail}")

    def log(self, name: str):
        if self.counts:
            logger.warning("%s: skipped %s (first: %s)", name, self.counts, "; ".join(self.examples[:3]))


# --------------------------------------------------------------------------------------------------------------
# Code generation (docstring <-> function) from Python source trees
# --------------------------------------------------------------------------------------------------------------
def default_python_source_dirs() -> list[Path]:
    """The running interpreter's standard library directory."""
    return [Path(sysconfig.get_paths()["stdlib"])]


_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git", ".tox", ".venv", "venv", "node_modules"}


def not_a_readable_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a source file -- a dangling symlink, a FIFO, socket or device (reading a
    FIFO blocks forever), no read permission -- or ``None`` for a regular readable file."""
    try:
        mode = os.stat(path).st_mode  # follows symlinks: a link to a regular file is fine
    except FileNotFoundError:
        return "dangling symlink" if os.path.islink(path) else "vanished file"
    except OSError as error:
        return f"unreadable file ({error.strerror})"
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if not os.access(path, os.R_OK):
        return "unreadable file (permission denied)"
    return None


def list_python_files(source_dirs: Iterable[str | os.PathLike], report: SkipReport | None = None) -> list[Path]:
    """Every ``.py`` file under the given directories (or the files themselves), sorted, skipping installed
    third-party packages (``site-packages``) and caches. Entries that are not regular readable files (dangling
    symlinks, FIFOs, ...) are skipped and counted in ``report``; a path given explicitly must be one."""
    files: list[Path] = []
    for source in source_dirs:
        source = Path(source)
        if source.is_dir():
            for dirpath, dirnames, filenames in os.walk(source):
                dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
                for name in sorted(filenames):
                    if not name.endswith(".py"):
                        continue
                    path = Path(dirpath) / name
                    problem = not_a_readable_file(path)
                    if problem is None:
                        files.append(path)
                    elif report is not None:
                        report.add(problem, str(path))
            continue
        if not os.path.lexists(source):
            raise ValueError(f"Python source path {source} does not exist")
        problem = not_a_readable_file(source)
        if problem is not None:
            raise ValueError(f"Python source path {source}: {problem}")
        files.append(source)
    return sorted(set(files))


def extract_documented_functions(path: Path, source_bytes: bytes | None = None) -> Iterator[tuple[str, str, int]]:
    """Yield ``(docstring, code_without_docstring, line)`` for every documented (async) function in a file.

    The file is only *parsed* (``ast.parse``); nothing is imported or executed. The code is the function
    re-generated with ``ast.unparse`` without its docstring: canonical formatting, no comments, parseable on its
    own (methods come out at indentation 0). Functions whose body is only the docstring are left out.
    Raises ``SyntaxError``/``ValueError``/``UnicodeDecodeError`` for files Python cannot parse.
    """
    if source_bytes is None:
        source_bytes = path.read_bytes()
    tree = ast.parse(source_bytes, filename=str(path))
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docstring = ast.get_docstring(node, clean=True)
        if not docstring or len(node.body) < 2:
            continue
        body_without_doc = node.body[1:]
        stripped = type(node)(**{**{f: getattr(node, f) for f in node._fields}, "body": body_without_doc})
        ast.copy_location(stripped, node)
        yield docstring, ast.unparse(stripped), node.lineno


def build_codegen_corpus(
    source_dirs: Iterable[str | os.PathLike] | None = None,
    direction: str = "doc2code",
    max_source_chars: int = 1024,
    max_target_chars: int = 2048,
    docstring: str = "full",
    strict: bool = False,
    ratios: tuple[int, int, int] = (80, 10, 10),
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> datasets.DatasetDict:
    """Docstring -> function-source pairs (``direction="doc2code"``) or the reverse (``"code2doc"``).

    ``docstring="full"`` uses the whole docstring with whitespace collapsed to single spaces;
    ``"summary"`` only its first paragraph. Pairs are deduplicated on (docstring, code); pairs whose docstring
    is longer than ``max_source_chars`` or code longer than ``max_target_chars`` (measured in the doc2code
    direction) are dropped. The split hashes the docstring, so identical docstrings never straddle splits.
    Files that do not parse are skipped and counted (``strict=True``: a ``ValueError`` naming the file).
    """
    if direction not in ("doc2code", "code2doc"):
        raise ValueError(f"direction must be 'doc2code' or 'code2doc', got {direction!r}")
    if docstring not in ("full", "summary"):
        raise ValueError(f"docstring must be 'full' or 'summary', got {docstring!r}")
    dirs = [Path(d) for d in (source_dirs or default_python_source_dirs())]
    listing = SkipReport()
    files = list_python_files(dirs, listing)
    listing.log("codegen corpus file scan")
    if not files:
        raise ValueError(f"No .py files found under {', '.join(map(str, dirs))}")
    params = dict(dirs=[str(d) for d in dirs], direction=direction, max_source_chars=max_source_chars,
                  max_target_chars=max_target_chars, docstring=docstring, strict=strict, ratios=ratios, v=1)

    def build():
        skipped = SkipReport()
        seen: set[tuple[str, str]] = set()
        rows = []
        for path in files:
            try:
                functions = list(extract_documented_functions(path))
            except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError) as error:
                if strict:
                    raise ValueError(f"{path}: cannot parse as Python: {error}") from error
                skipped.add("unparseable file", f"{path}: {type(error).__name__}")
                continue
            except OSError as error:  # removed or made unreadable since the scan
                if strict:
                    raise ValueError(f"{path}: cannot read: {error}") from error
                skipped.add("unreadable file", f"{path}: {error.strerror}")
                continue
            for doc, code, line in functions:
                if docstring == "summary":
                    doc = doc.split("\n\n", 1)[0]
                doc = _collapse(doc)
                if not doc:
                    continue
                if len(doc) > max_source_chars or len(code) > max_target_chars:
                    skipped.add("over length cap", f"{path}:{line}")
                    continue
                if (doc, code) in seen:
                    skipped.add("duplicate", f"{path}:{line}")
                    continue
                seen.add((doc, code))
                source, target = (doc, code) if direction == "doc2code" else (code, doc)
                rows.append({"source": source, "target": target, "origin": f"{path}:{line}"})
        skipped.log("codegen corpus")
        if not rows:
            raise ValueError(f"No documented functions found in {len(files)} Python files under {params['dirs']}")
        doc_of = (lambda r: r["source"]) if direction == "doc2code" else (lambda r: r["target"])
        return _to_dataset_dict(rows, doc_of, ratios)

    return _cached(f"codegen-{direction}", params, files, build, cache_dir, use_cache)


# --------------------------------------------------------------------------------------------------------------
# Translation from gettext catalogs
# --------------------------------------------------------------------------------------------------------------
_FORMAT_SPEC = re.compile(
    r"%(\([^)]*\))?[-#0 +'I]*(\*|\d+\$?)?(\.(\*|\d+))?(hh|h|ll|l|L|q|j|z|t)?[diouxXeEfFgGcrsaApn%]"
    r"|\{[^{}]*\}|\$\{?\w+\}?|<[^<>]+>|&\w+;"
)
_LETTER = re.compile(r"[^\W\d_]")


def has_words(text: str) -> bool:
    """Whether ``text`` contains a letter once format specifiers / placeholders / markup are removed."""
    return bool(_LETTER.search(_FORMAT_SPEC.sub(" ", text)))


def read_mo_catalog(path: Path) -> Iterator[tuple[str, str]]:
    """Yield (msgid, msgstr) from one ``.mo`` file (stdlib ``gettext``): header skipped, message context
    stripped, for plural entries only the singular msgid with its first translated form.
    Raises ``ValueError`` naming the file when it is not a readable gettext catalog."""
    try:
        with open(path, "rb") as handle:
            catalog = gettext.GNUTranslations(handle)._catalog
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: gettext catalog is not valid UTF-8 ({error.reason} at byte {error.start})") from error
    except (OSError, struct.error) as error:
        raise ValueError(f"{path}: not a readable gettext .mo catalog ({error})") from error
    for key, msgstr in catalog.items():
        if isinstance(key, tuple):
            msgid, form = key
            if form != 0:
                continue
        else:
            msgid = key
        if not msgid:
            continue  # header entry
        msgid = msgid.split("\x04", 1)[-1]  # drop msgctxt
        yield msgid, msgstr


def build_gettext_corpus(
    target_lang: str = "de",
    locale_dir: str | os.PathLike = "/usr/share/locale",
    max_chars: int = 500,
    strict: bool = False,
    ratios: tuple[int, int, int] = (80, 10, 10),
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    catalog_files: Iterable[str | os.PathLike] | None = None,
) -> datasets.DatasetDict:
    """English (msgid) -> ``target_lang`` (msgstr) pairs from every ``<locale_dir>/<lang>/LC_MESSAGES/*.mo``.

    Whitespace is collapsed; entries are dropped when either side is empty, has no letters once format
    specifiers/placeholders/markup are removed (format-only strings like ``"%s: %s"``), or exceeds ``max_chars``.
    Pairs are deduplicated; the split hashes the msgid. Catalogs that cannot be read (e.g. a non-UTF-8 header,
    which the stdlib parser rejects) are skipped and counted (``strict=True``: a ``ValueError`` naming the file).
    ``catalog_files`` replaces the directory scan with explicit ``.mo`` files.
    """
    if catalog_files is not None:
        files = sorted(Path(f) for f in catalog_files)
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"gettext catalog file(s) not found: {', '.join(missing)}")
    else:
        messages_dir = Path(locale_dir) / target_lang / "LC_MESSAGES"
        if not messages_dir.is_dir():
            available = sorted(p.parent.name for p in Path(locale_dir).glob("*/LC_MESSAGES"))
            raise ValueError(
                f"No gettext catalogs for language {target_lang!r}: {messages_dir} does not exist "
                f"(available: {', '.join(available[:40])}{' ...' if len(available) > 40 else ''})"
            )
        files = sorted(messages_dir.glob("*.mo"))
    if not files:
        raise ValueError(f"No .mo files for language {target_lang!r} under {locale_dir}")
    params = dict(lang=target_lang, files=[str(f) for f in files], max_chars=max_chars, strict=strict, ratios=ratios, v=1)

    def build():
        skipped = SkipReport()
        seen: set[tuple[str, str]] = set()
        rows = []
        for path in files:
            try:
                entries = list(read_mo_catalog(path))
            except ValueError as error:
                if strict:
                    raise
                skipped.add("unreadable catalog", str(error))
                continue
            for msgid, msgstr in entries:
                source, target = _collapse(msgid), _collapse(msgstr)
                if not source or not target:
                    skipped.add("empty", path.name)
                    continue
                if not has_words(source) or not has_words(target):
                    skipped.add("format-only", f"{path.name}: {source!r}")
                    continue
                if len(source) > max_chars or len(target) > max_chars:
                    skipped.add("over length cap", path.name)
                    continue
                if (source, target) in seen:
                    skipped.add("duplicate", path.name)
                    continue
                seen.add((source, target))
                rows.append({"source": source, "target": target, "origin": path.name})
        skipped.log(f"gettext en->{target_lang} corpus")
        if not rows:
            raise ValueError(f"No usable message pairs in {len(files)} catalogs for {target_lang!r}")
        return _to_dataset_dict(rows, lambda r: r["source"], ratios)

    return _cached(f"gettext-en-{target_lang}", params, files, build, cache_dir, use_cache)


# --------------------------------------------------------------------------------------------------------------
# Word order recovery
# --------------------------------------------------------------------------------------------------------------
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def shuffle_words(sentence: str) -> str:
    """The sentence's whitespace-separated words in a pseudo-random order seeded by the sentence itself
    (deterministic), different from the original whenever the words are not all identical."""
    words = sentence.split()
    rng = random.Random(hashlib.sha256(sentence.encode("utf-8")).digest())
    shuffled = list(words)
    for _ in range(10):
        rng.shuffle(shuffled)
        if shuffled != words:
            break
    return " ".join(shuffled)


def english_sentences(texts: Iterable[str], min_words: int, max_words: int) -> Iterator[str]:
    """Sentences of ``min_words``..``max_words`` words that are mostly words (letters), from free text."""
    for text in texts:
        for sentence in _SENTENCE_END.split(_collapse(text)):
            words = sentence.split()
            if not (min_words <= len(words) <= max_words):
                continue
            if sum(bool(_LETTER.search(w)) for w in words) < 0.8 * len(words):
                continue
            yield sentence


def build_word_order_corpus(
    base: str = "codegen",
    min_words: int = 4,
    max_words: int = 30,
    ratios: tuple[int, int, int] = (80, 10, 10),
    base_kwargs: dict | None = None,
) -> datasets.DatasetDict:
    """Shuffled English sentence -> the sentence in its original order (InDIGO's word order recovery).

    Sentences come from the English side of ``base``: ``"codegen"`` (docstrings of the code corpus) or
    ``"gettext"`` (msgids). Deduplicated; the split hashes the original sentence (so it is independent of the
    base corpus's split: every English sentence of the base corpus is used).
    """
    base_kwargs = dict(base_kwargs or {})
    if base == "codegen":
        corpus = build_codegen_corpus(**base_kwargs)
        texts = (text for split in SPLITS for text in corpus[split]["source"])
    elif base == "gettext":
        corpus = build_gettext_corpus(**base_kwargs)
        texts = (text for split in SPLITS for text in corpus[split]["source"])
    else:
        raise ValueError(f"word order base corpus must be 'codegen' or 'gettext', got {base!r}")
    seen: set[str] = set()
    rows = []
    for sentence in english_sentences(texts, min_words, max_words):
        if sentence in seen:
            continue
        seen.add(sentence)
        rows.append({"source": shuffle_words(sentence), "target": sentence, "origin": base})
    if not rows:
        raise ValueError(f"No sentences of {min_words}-{max_words} words in the {base} corpus")
    return _to_dataset_dict(rows, lambda r: r["target"], ratios)


# --------------------------------------------------------------------------------------------------------------
# User files and Hub datasets
# --------------------------------------------------------------------------------------------------------------
def _file_format(path: Path, file_format: str | None) -> str:
    if file_format:
        fmt = file_format.lower()
    else:
        suffix = path.suffix.lower().lstrip(".")
        fmt = {"tsv": "tsv", "tab": "tsv", "txt": "tsv", "csv": "csv", "jsonl": "jsonl", "json": "jsonl"}.get(suffix)
        if fmt is None:
            raise ValueError(f"{path}: cannot tell the format from the extension; pass --file_format tsv|csv|jsonl")
    if fmt not in ("tsv", "csv", "jsonl"):
        raise ValueError(f"{path}: unsupported file format {fmt!r} (tsv, csv, jsonl)")
    return fmt


def read_parallel_file(
    path: str | os.PathLike,
    source_column: str = "source",
    target_column: str = "target",
    file_format: str | None = None,
    skip_bad_lines: bool = False,
    report: SkipReport | None = None,
) -> list[dict]:
    """Rows ``{"source", "target", "origin"}`` from one TSV / CSV / JSONL file.

    TSV/CSV: a header row names the columns, unless both column names are integers (0-based positions, no
    header). TSV has one record per line; CSV is read with the ``csv`` module (RFC 4180: quoted fields may hold
    commas and newlines; a record is reported by its first line). JSONL: one JSON object per line with the two
    keys. Every problem -- missing file, empty file, non-UTF-8 bytes, malformed JSON/CSV, missing column, more or
    fewer fields than the header (without one, than the first record), empty or non-string field -- raises a
    ``ValueError`` naming the file and line, or (``skip_bad_lines=True``) skips that record and counts it in
    ``report``.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a data file")
    if not path.is_file():
        # a FIFO would block the read forever; a dangling link or a missing file has nothing to read
        kind = "not a regular file" if path.exists() else "file not found"
        raise ValueError(f"{path}: {kind}")
    if source_column == target_column:
        raise ValueError(f"--source_column and --target_column are both {source_column!r}: the model would learn to "
                         "copy its input")
    fmt = _file_format(path, file_format)
    report = report if report is not None else SkipReport()
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ValueError(f"{path}: cannot be read ({error.strerror or error})") from error
    if not raw.strip():
        raise ValueError(f"{path}: file is empty")
    rows: list[dict] = []

    def bad(line_number: int, message: str):
        if skip_bad_lines:
            report.add(message.split(":")[0], f"{path}:{line_number}")
            return
        raise ValueError(f"{path}, line {line_number}: {message}")

    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    decoded: list[tuple[int, str]] = []
    for number, line in enumerate(lines, start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as error:
            bad(number, f"not valid UTF-8 (byte {error.start}: {line[error.start:error.start + 1]!r})")
            continue
        if number == 1:
            text = text.lstrip("\ufeff")
        decoded.append((number, text.rstrip("\r")))

    def add(number: int, source, target):
        if not isinstance(source, str) or not isinstance(target, str):
            bad(number, f"non-string value in column {source_column!r} or {target_column!r}")
            return
        if not source.strip() or not target.strip():
            bad(number, f"empty {'source' if not source.strip() else 'target'} field")
            return
        rows.append({"source": source.strip(), "target": target.strip(), "origin": f"{path.name}:{number}"})

    if fmt == "jsonl":
        for number, text in decoded:
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                bad(number, f"malformed JSON ({error.msg} at column {error.colno})")
                continue
            if not isinstance(record, dict):
                bad(number, f"expected a JSON object, got {type(record).__name__}")
                continue
            missing = [c for c in (source_column, target_column) if c not in record]
            if missing:
                bad(number, f"missing column(s) {missing}; found {sorted(record)}")
                continue
            add(number, record[source_column], record[target_column])
    else:
        records = list(_delimited_records(decoded, fmt))
        if not any(fields for _, fields, _ in records):
            raise ValueError(f"{path}: file has no non-empty lines")
        positional = source_column.isdigit() and target_column.isdigit()
        header_number = None
        if not positional:
            header_number, header, error = records.pop(0)
            if error is not None:
                raise ValueError(f"{path}, line {header_number}: malformed CSV header ({error})")
            missing = [c for c in (source_column, target_column) if c not in header]
            repeated = [c for c in (source_column, target_column) if header.count(c) > 1]
            if repeated:
                # which of the two columns is meant cannot be told: taking the first could train on the wrong text
                raise ValueError(f"{path}, line {header_number}: the header names column {repeated[0]!r} twice")
            if missing:
                raise ValueError(
                    f"{path}, line {header_number}: header has no column(s) {missing}; found {header} "
                    f"(for a file without header pass 0-based column numbers, e.g. --source_column 0 --target_column 1)"
                )
            source_index, target_index = header.index(source_column), header.index(target_column)
            expected = len(header)
        else:
            source_index, target_index = int(source_column), int(target_column)
            expected = None  # the file's first record sets the shape
        needed = max(source_index, target_index) + 1
        for number, fields, error in records:
            if error is not None:
                bad(number, f"malformed CSV ({error})")
                continue
            if expected is None:
                expected, header_number = max(len(fields), needed), number
            shape = f"as in the header on line {header_number}" if not positional else f"as on line {header_number}"
            if len(fields) < needed:
                bad(number, f"missing column: expected {expected} {fmt.upper()} fields ({shape}), found {len(fields)}")
                continue
            if len(fields) != expected:
                # A stray tab or comma inside a text splits it: taking two of the fields would train on half of it.
                bad(number, f"{'too many' if len(fields) > expected else 'too few'} fields: expected {expected} "
                    f"{fmt.upper()} fields ({shape}), found {len(fields)}")
                continue
            add(number, fields[source_index], fields[target_index])
    if not rows:
        raise ValueError(f"{path}: no usable (source, target) pairs" + (f" (skipped {report.counts})" if report.counts else ""))
    return rows


def _delimited_records(decoded: list[tuple[int, str]], fmt: str) -> Iterator[tuple[int, list[str] | None, str | None]]:
    """``(first line number, fields, None)`` per record of a TSV or CSV file, ``(line, None, error)`` for a malformed
    one; blank lines are left out. TSV: one record per line, fields split on tabs. CSV: the ``csv`` module over the
    whole file (RFC 4180: a quoted field may hold commas, quotes and newlines), numbered by the record's first line."""
    if fmt == "tsv":
        for number, text in decoded:
            if text.strip():
                yield number, text.split("\t"), None
        return
    numbers = [number for number, _ in decoded]
    reader = csv.reader((text + "\n" for _, text in decoded), delimiter=",", strict=True)
    start = 0
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as error:
            yield numbers[start], None, str(error)
            start = reader.line_num
            continue
        first, start = numbers[start], reader.line_num
        if fields and not (len(fields) == 1 and not fields[0].strip()):
            yield first, fields, None


def load_parallel_files(
    train_file: str | os.PathLike,
    validation_file: str | os.PathLike | None = None,
    test_file: str | os.PathLike | None = None,
    source_column: str = "source",
    target_column: str = "target",
    file_format: str | None = None,
    skip_bad_lines: bool = False,
    ratios: tuple[int, int, int] = (80, 10, 10),
) -> datasets.DatasetDict:
    """The user's own parallel data. With only ``train_file``, it is split 80/10/10 by hashing each source;
    with validation/test files, each file is one split (a missing test split reuses validation)."""
    report = SkipReport()
    read = lambda f: read_parallel_file(f, source_column, target_column, file_format, skip_bad_lines, report)  # noqa: E731
    if validation_file is None and test_file is None:
        corpus = _to_dataset_dict(read(train_file), lambda r: r["source"], ratios)
    else:
        splits = {"train": read(train_file)}
        splits["validation"] = read(validation_file) if validation_file else read(test_file)
        splits["test"] = read(test_file) if test_file else splits["validation"]
        corpus = datasets.DatasetDict({k: _dataset(v) for k, v in splits.items()})
    report.log("parallel files")
    return corpus


def load_hub_corpus(
    name: str,
    config_name: str | None = None,
    source_column: str = "source",
    target_column: str = "target",
    source_lang: str | None = None,
    target_lang: str | None = None,
) -> datasets.DatasetDict:
    """A ``datasets.load_dataset`` corpus mapped to ``source``/``target`` columns: the two named columns when the
    dataset has them, else the usual ``translation`` dict column with ``source_lang``/``target_lang`` keys.
    Needs the Hub (or a local cache)."""
    try:
        raw = datasets.load_dataset(name, config_name)
    except ConnectionError as error:  # offline (HF_HUB_OFFLINE) or no network, and not in the local cache
        raise ValueError(f"dataset {name!r} is not in the local cache and the Hub cannot be reached "
                         f"(offline or no network): {error}") from error
    out = {}
    for split, dataset in raw.items():
        key = {"dev": "validation", "valid": "validation"}.get(split, split)
        has_columns = source_column in dataset.column_names and target_column in dataset.column_names
        if not has_columns and "translation" in dataset.column_names and source_lang and target_lang:
            pairs = dataset["translation"]
            if pairs and (source_lang not in pairs[0] or target_lang not in pairs[0]):
                raise ValueError(f"{name}[{split}] 'translation' has languages {sorted(pairs[0])}, not {source_lang}/{target_lang}")
            rows = [{"source": p[source_lang], "target": p[target_lang], "origin": f"{name}:{split}:{i}"} for i, p in enumerate(pairs)]
        else:
            missing = [c for c in (source_column, target_column) if c not in dataset.column_names]
            if missing:
                raise ValueError(f"{name}[{split}] has no column(s) {missing} (columns: {dataset.column_names})")
            rows = [
                {"source": s, "target": t, "origin": f"{name}:{split}:{i}"}
                for i, (s, t) in enumerate(zip(dataset[source_column], dataset[target_column]))
            ]
        out[key] = _dataset(rows)
    if "train" not in out:
        raise ValueError(f"{name} has no train split (splits: {list(raw)})")
    if "validation" not in out:
        split = out["train"].train_test_split(test_size=0.1, seed=0)
        out["train"], out["validation"] = split["train"], split["test"]
    out.setdefault("test", out["validation"])
    return datasets.DatasetDict(out)


def escape_line(text: str) -> str:
    """One-line form of a (possibly multi-line) text for line-oriented files: ``\\`` -> ``\\\\``, newline -> ``\\n``."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def unescape_line(text: str) -> str:
    """Inverse of :func:`escape_line`."""
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r", "t": "\t"}.get(m.group(1), m.group(1)), text)


def read_text_lines(path: str | os.PathLike) -> list[str]:
    """Lines of a UTF-8 text file; a ``ValueError`` naming file and line for bytes that are not UTF-8."""
    lines = []
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                lines.append(line.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}, line {number}: not valid UTF-8 (byte {error.start})") from error
    return lines


__all__ = [
    "SPLITS",
    "SkipReport",
    "build_codegen_corpus",
    "build_gettext_corpus",
    "build_word_order_corpus",
    "english_sentences",
    "escape_line",
    "extract_documented_functions",
    "has_words",
    "list_python_files",
    "load_corpus",
    "load_hub_corpus",
    "load_parallel_files",
    "read_mo_catalog",
    "read_parallel_file",
    "read_text_lines",
    "shuffle_words",
    "split_of",
    "unescape_line",
]


def load_corpus(data_args) -> datasets.DatasetDict:
    """The corpus selected by a :class:`training_scripts.arguments.DataArguments` (``--task`` and its options)."""
    task = data_args.task
    if task in ("codegen", "code2doc"):
        return build_codegen_corpus(
            data_args.python_source_dirs,
            direction="doc2code" if task == "codegen" else "code2doc",
            max_source_chars=data_args.max_source_chars,
            max_target_chars=data_args.max_target_chars,
            docstring=data_args.docstring,
        )
    if task == "translation":
        return build_gettext_corpus(data_args.target_lang, data_args.locale_dir)
    if task == "word_order":
        if data_args.word_order_base == "gettext":
            base_kwargs = {"target_lang": data_args.target_lang, "locale_dir": data_args.locale_dir}
        else:
            base_kwargs = {"source_dirs": data_args.python_source_dirs, "docstring": data_args.docstring}
        return build_word_order_corpus(data_args.word_order_base, base_kwargs=base_kwargs)
    if task == "files":
        return load_parallel_files(
            data_args.train_file,
            data_args.validation_file,
            data_args.test_file,
            data_args.source_column,
            data_args.target_column,
            data_args.file_format,
            data_args.skip_bad_lines,
        )
    if task == "hub":
        return load_hub_corpus(
            data_args.dataset_name,
            data_args.dataset_config_name,
            data_args.source_column,
            data_args.target_column,
            data_args.source_lang,
            data_args.target_lang,
        )
    raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
