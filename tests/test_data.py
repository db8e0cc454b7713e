"""Pipeline corpora: code generation from Python sources, gettext translation, word order, user files."""

import ast
import struct
import sysconfig
from pathlib import Path

import pytest

from flexformers.training_scripts.data import (
    build_codegen_corpus,
    build_gettext_corpus,
    build_word_order_corpus,
    escape_line,
    extract_documented_functions,
    has_words,
    load_parallel_files,
    read_mo_catalog,
    read_parallel_file,
    shuffle_words,
    split_of,
    unescape_line,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
REAL_PY_FILES = [STDLIB / "json" / "decoder.py", STDLIB / "json" / "encoder.py", STDLIB / "textwrap.py"]
GERMAN_MO = Path("/usr/share/locale/de/LC_MESSAGES")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXFORMERS_CACHE", str(tmp_path / "cache"))


def write_mo(path: Path, messages: dict, charset: str = "UTF-8", header: bytes | None = None) -> Path:
    """A GNU .mo file: keys are msgids (``"ctx\\x04id"`` for context, ``(singular, plural)`` for plurals)."""
    if header is None:
        header = f"Content-Type: text/plain; charset={charset}\nPlural-Forms: nplurals=2; plural=(n != 1);\n".encode()
    entries = {b"": header}
    for key, value in messages.items():
        if isinstance(key, tuple):
            entries[key[0].encode() + b"\0" + key[1].encode()] = b"\0".join(v.encode(charset) for v in value)
        else:
            entries[key.encode(charset)] = value.encode(charset)
    keys = sorted(entries)
    ids = b"".join(k + b"\0" for k in keys)
    strs = b"".join(entries[k] + b"\0" for k in keys)
    count = len(keys)
    originals_offset = 28
    translations_offset = originals_offset + 8 * count
    ids_start = translations_offset + 8 * count
    strs_start = ids_start + len(ids)
    table_ids, table_strs = [], []
    offset = 0
    for key in keys:
        table_ids += [len(key), ids_start + offset]
        offset += len(key) + 1
    offset = 0
    for key in keys:
        table_strs += [len(entries[key]), strs_start + offset]
        offset += len(entries[key]) + 1
    data = struct.pack("<7I", 0x950412DE, 0, count, originals_offset, translations_offset, 0, ids_start)
    data += struct.pack(f"<{2 * count}I", *table_ids) + struct.pack(f"<{2 * count}I", *table_strs) + ids + strs
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------------------------------------------------- split
def test_split_is_a_pure_function_of_the_key_with_80_10_10_proportions():
    keys = [f"example {i}" for i in range(20000)]
    splits = [split_of(k) for k in keys]
    assert splits == [split_of(k) for k in keys]
    fractions = {name: splits.count(name) / len(keys) for name in ("train", "validation", "test")}
    assert abs(fractions["train"] - 0.8) < 0.02 and abs(fractions["validation"] - 0.1) < 0.015
    with pytest.raises(ValueError, match="ratios"):
        split_of("x", (80, 10))


# ---------------------------------------------------------------------------------------------------- codegen
def test_codegen_pairs_from_real_stdlib_files(tmp_path):
    corpus = build_codegen_corpus(REAL_PY_FILES, use_cache=False)
    rows = [row for split in ("train", "validation", "test") for row in corpus[split]]
    assert len(rows) > 15
    by_origin = {row["origin"].split("/")[-1]: row for row in rows}
    dedent = next(row for row in rows if row["target"].startswith("def dedent("))
    assert dedent["source"].startswith("Remove any common leading whitespace from every line in `text`.")
    assert '"""' not in dedent["target"] and "Remove any common" not in dedent["target"]
    for row in rows:  # every target is standalone, parseable Python without its docstring
        ast.parse(row["target"])
        assert "\n" not in row["source"] and "  " not in row["source"]
    assert all(":" in origin for origin in by_origin)


def test_codegen_is_deterministic_and_splits_do_not_move_when_files_are_added(tmp_path):
    small = build_codegen_corpus(REAL_PY_FILES[:1], use_cache=False)
    again = build_codegen_corpus(REAL_PY_FILES[:1], use_cache=False)
    large = build_codegen_corpus(REAL_PY_FILES, use_cache=False)
    for split in ("train", "validation", "test"):
        assert small[split]["target"] == again[split]["target"]
        assert set(small[split]["target"]) <= set(large[split]["target"])


def test_codegen_never_executes_code_and_counts_unparseable_files(tmp_path, caplog):
    marker = tmp_path / "executed"
    (tmp_path / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\nraise SystemExit(3)\n\n"
        "def add(a, b):\n    '''Add two numbers.'''\n    return a + b\n\n"
        "def only_doc():\n    '''Nothing to generate.'''\n"
    )
    (tmp_path / "broken.py").write_text("def f(:\n    pass\n")
    corpus = build_codegen_corpus([tmp_path], use_cache=False)
    rows = [row for split in corpus.values() for row in split]
    assert [(r["source"], r["target"]) for r in rows] == [("Add two numbers.", "def add(a, b):\n    return a + b")]
    assert not marker.exists()
    assert "unparseable file" in caplog.text
    with pytest.raises(ValueError, match="broken.py: cannot parse"):
        build_codegen_corpus([tmp_path], strict=True, use_cache=False)


def test_codegen_dedup_length_cap_reverse_direction_and_summary(tmp_path):
    body = "def f(x):\n    '''Double it.\n\n    Longer explanation here.'''\n    return 2 * x\n"
    (tmp_path / "a.py").write_text(body + "\n\n" + body.replace("f(x)", "g(x)").replace("2 * x", "x" * 300))
    (tmp_path / "b.py").write_text(body)  # exact duplicate of a.py's first function
    corpus = build_codegen_corpus([tmp_path], use_cache=False, max_target_chars=100)
    rows = [row for split in corpus.values() for row in split]
    assert len(rows) == 1 and rows[0]["source"] == "Double it. Longer explanation here."
    reverse = build_codegen_corpus([tmp_path], direction="code2doc", docstring="summary", use_cache=False, max_target_chars=100)
    rows = [row for split in reverse.values() for row in split]
    assert rows[0]["source"].startswith("def f(x):") and rows[0]["target"] == "Double it."
    with pytest.raises(ValueError, match="direction"):
        build_codegen_corpus([tmp_path], direction="sideways")
    with pytest.raises(ValueError, match="does not exist"):
        build_codegen_corpus([tmp_path / "missing"])


def test_codegen_cache_roundtrip(tmp_path):
    first = build_codegen_corpus(REAL_PY_FILES[:1], cache_dir=tmp_path / "c")
    assert any((tmp_path / "c").iterdir())
    second = build_codegen_corpus(REAL_PY_FILES[:1], cache_dir=tmp_path / "c")
    assert first["train"]["target"] == second["train"]["target"]


def test_extract_documented_functions_handles_async_and_methods():
    source = b"class A:\n    async def run(self):\n        '''Run it.'''\n        await x()\n"
    assert list(extract_documented_functions(Path("m.py"), source)) == [("Run it.", "async def run(self):\n    await x()", 2)]


# ---------------------------------------------------------------------------------------------------- gettext
def test_gettext_filters_plural_context_format_only_and_dedups(tmp_path):
    mo = write_mo(
        tmp_path / "app.mo",
        {
            "Open file": "Datei öffnen",
            "menu\x04Quit": "Beenden",
            ("%d file", "%d files"): ["%d Datei", "%d Dateien"],
            "%s: %s": "%s: %s",
            "  Save\n  as ": "Speichern unter",
            "Untranslated": "",
        },
    )
    copy = write_mo(tmp_path / "other.mo", {"Open file": "Datei öffnen"})
    corpus = build_gettext_corpus(catalog_files=[mo, copy], use_cache=False)
    pairs = sorted((r["source"], r["target"]) for split in corpus.values() for r in split)
    assert pairs == sorted(
        [("Open file", "Datei öffnen"), ("Quit", "Beenden"), ("%d file", "%d Datei"), ("Save as", "Speichern unter")]
    )
    assert has_words("%(name)s files") and not has_words("%s: %-5d {0} <b>%%</b>")


def test_gettext_bad_catalogs_are_named_or_counted(tmp_path):
    good = write_mo(tmp_path / "good.mo", {"Hello": "Hallo"})
    latin = write_mo(tmp_path / "latin.mo", {"Yes": "Jä"}, header="Last-Translator: B\xe4r\n".encode("latin-1"))
    corrupt = tmp_path / "corrupt.mo"
    corrupt.write_bytes(b"not a catalog at all")
    with pytest.raises(ValueError, match="latin.mo: gettext catalog is not valid UTF-8"):
        list(read_mo_catalog(latin))
    with pytest.raises(ValueError, match="corrupt.mo: not a readable gettext"):
        list(read_mo_catalog(corrupt))
    corpus = build_gettext_corpus(catalog_files=[good, latin, corrupt], use_cache=False)
    assert sum(len(split) for split in corpus.values()) == 1
    with pytest.raises(ValueError, match="latin.mo"):
        build_gettext_corpus(catalog_files=[good, latin], strict=True, use_cache=False)
    with pytest.raises(ValueError, match="No gettext catalogs for language 'xx'"):
        build_gettext_corpus("xx", locale_dir=tmp_path)


@pytest.mark.skipif(not GERMAN_MO.is_dir(), reason="no German gettext catalogs on this machine")
def test_gettext_on_one_real_catalog():
    catalog = max(GERMAN_MO.glob("*.mo"), key=lambda p: p.stat().st_size if p.stat().st_size < 200_000 else 0)
    corpus = build_gettext_corpus(catalog_files=[catalog], use_cache=False)
    rows = [r for split in corpus.values() for r in split]
    assert len(rows) > 10
    assert all(r["source"] and r["target"] and "\n" not in r["source"] for r in rows)
    assert sum(r["source"] != r["target"] for r in rows) > 0.5 * len(rows)


# ---------------------------------------------------------------------------------------------------- word order
def test_word_order_recovery_pairs():
    sentence = "Return the list of all files in the directory."
    shuffled = shuffle_words(sentence)
    assert shuffled == shuffle_words(sentence) and shuffled != sentence
    assert sorted(shuffled.split()) == sorted(sentence.split())
    corpus = build_word_order_corpus("codegen", base_kwargs={"source_dirs": REAL_PY_FILES, "use_cache": False})
    rows = [r for split in corpus.values() for r in split]
    assert len(rows) > 10
    for row in rows:
        assert sorted(row["source"].split()) == sorted(row["target"].split())
        assert 4 <= len(row["target"].split()) <= 30
    assert len({r["target"] for r in rows}) == len(rows)
    with pytest.raises(ValueError, match="base corpus"):
        build_word_order_corpus("poetry")


# ---------------------------------------------------------------------------------------------------- user files
def test_user_files_tsv_csv_jsonl(tmp_path):
    (tmp_path / "d.tsv").write_text("source\ttarget\nHello\tHallo\nGood day\tGuten Tag\n")
    (tmp_path / "plain.tsv").write_text("Hello\tHallo\n")
    (tmp_path / "d.csv").write_text('en,de\n"Hello, you",Hallo du\n')
    (tmp_path / "d.jsonl").write_text('{"en": "Yes", "de": "Ja"}\n\n{"en": "No", "de": "Nein"}\n')
    assert [(r["source"], r["target"]) for r in read_parallel_file(tmp_path / "d.tsv")] == [("Hello", "Hallo"), ("Good day", "Guten Tag")]
    assert read_parallel_file(tmp_path / "plain.tsv", "0", "1")[0]["target"] == "Hallo"
    assert read_parallel_file(tmp_path / "d.csv", "en", "de")[0]["source"] == "Hello, you"
    assert [r["origin"] for r in read_parallel_file(tmp_path / "d.jsonl", "en", "de")] == ["d.jsonl:1", "d.jsonl:3"]
    corpus = load_parallel_files(tmp_path / "d.tsv", validation_file=tmp_path / "d.tsv")
    assert len(corpus["validation"]) == 2 and corpus["test"]["source"] == corpus["validation"]["source"]


@pytest.mark.parametrize(
    "name, content, columns, message",
    [
        ("empty.tsv", b"", ("source", "target"), "empty.tsv: file is empty"),
        ("blank.jsonl", b"\n  \n", ("source", "target"), "blank.jsonl: file is empty"),
        ("nocol.tsv", b"src\ttgt\na\tb\n", ("source", "target"), r"nocol.tsv, line 1: header has no column"),
        ("short.tsv", b"source\ttarget\nonly one field\n", ("source", "target"),
         r"short.tsv, line 2: missing column: expected 2 TSV fields \(as in the header on line 1\), found 1"),
        ("latin.tsv", b"source\ttarget\nok\tgut\nB\xe4r\tbear\n", ("source", "target"), r"latin.tsv, line 3: not valid UTF-8"),
        ("bad.jsonl", b'{"source": "a", "target": "b"}\n{"source": "a",\n', ("source", "target"), r"bad.jsonl, line 2: malformed JSON"),
        ("list.jsonl", b"[1, 2]\n", ("source", "target"), r"list.jsonl, line 1: expected a JSON object"),
        ("key.jsonl", b'{"source": "a"}\n', ("source", "target"), r"key.jsonl, line 1: missing column"),
        ("num.jsonl", b'{"source": "a", "target": 3}\n', ("source", "target"), r"num.jsonl, line 1: non-string"),
        ("hole.csv", b"source,target\na,\n", ("source", "target"), r"hole.csv, line 2: empty target"),
        ("quote.csv", b'source,target\n"a"x,b\n', ("source", "target"), r"quote.csv, line 2: malformed CSV"),
        ("data.xml", b"<a/>", ("source", "target"), "cannot tell the format"),
    ],
)
def test_user_file_errors_name_file_and_line(tmp_path, name, content, columns, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        read_parallel_file(path, *columns)


def test_user_file_bad_lines_can_be_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "mixed.tsv"
    path.write_bytes(b"source\ttarget\nok\tgut\nB\xe4r\tbear\nlonely\n\tempty source\nfine\tfein\n")
    corpus = load_parallel_files(path, validation_file=path, skip_bad_lines=True)
    assert [r["source"] for r in corpus["train"]] == ["ok", "fine"]
    assert "skipped" in caplog.text and "not valid UTF-8" in caplog.text
    with pytest.raises(ValueError, match="file not found"):
        read_parallel_file(tmp_path / "absent.tsv")


def test_escape_line_roundtrip():
    text = "def f():\n\treturn '\\\\n'\r"
    escaped = escape_line(text)
    # no line break of any kind is left (a reader with universal newlines splits on a lone \r too), and no tab (the
    # TSV separator)
    assert not {"\n", "\r", "\t"} & set(escaped) and unescape_line(escaped) == text
    assert escape_line("a\rb") == "a\\rb"


# ------------------------------------------------------------------------------- surviving mutants (issue 65)
from flexformers.training_scripts.data import SPLITS


def test_cache_root_follows_flexformers_cache_else_home(tmp_path, monkeypatch):
    from flexformers.training_scripts.data import cache_root

    assert cache_root() == tmp_path / "cache" / "corpora"  # the autouse fixture's FLEXFORMERS_CACHE
    monkeypatch.delenv("FLEXFORMERS_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "flexformers" / "corpora"


def test_default_python_source_dirs_is_the_running_stdlib():
    from flexformers.training_scripts.data import default_python_source_dirs

    assert default_python_source_dirs() == [STDLIB]
    assert (default_python_source_dirs()[0] / "textwrap.py").is_file()


def test_list_python_files_skips_and_counts_dangling_links_and_fifos(tmp_path):
    import os

    from flexformers.training_scripts.data import SkipReport, list_python_files

    (tmp_path / "good.py").write_text("x = 1\n")
    (tmp_path / "dangling.py").symlink_to(tmp_path / "missing.py")
    os.mkfifo(tmp_path / "pipe.py")  # reading a FIFO would block the corpus build forever
    report = SkipReport()
    assert list_python_files([tmp_path], report) == [tmp_path / "good.py"]
    assert report.counts == {"dangling symlink": 1, "not a regular file": 1}


def test_extract_documented_functions_dedents_docstrings_so_summary_splits_on_indented_blank_lines(tmp_path):
    # the blank docstring line keeps its indentation (as many editors leave it): only a cleaned docstring has "\n\n"
    source = "def f(x):\n    '''Double it.\n    \n    Longer explanation here.\n    '''\n    return 2 * x\n"
    (tmp_path / "a.py").write_text(source)
    [(doc, code, line)] = extract_documented_functions(tmp_path / "a.py")
    assert (doc, code, line) == ("Double it.\n\nLonger explanation here.", "def f(x):\n    return 2 * x", 1)
    corpus = build_codegen_corpus([tmp_path], docstring="summary", use_cache=False)
    assert [r["source"] for split in corpus.values() for r in split] == ["Double it."]


def test_codegen_skip_summary_names_the_corpus_and_the_reason(tmp_path, caplog):
    (tmp_path / "ok.py").write_text("def add(a, b):\n    '''Add two numbers.'''\n    return a + b\n")
    (tmp_path / "broken.py").write_text("def f(:\n    pass\n")
    build_codegen_corpus([tmp_path], use_cache=False)
    assert "codegen corpus: skipped {'unparseable file': 1} (first: unparseable file: " in caplog.text


@pytest.mark.parametrize("direction", ["doc2code", "code2doc"])
def test_codegen_split_hashes_the_docstring_so_a_docstring_never_straddles_splits(tmp_path, direction):
    docs = ["Return a constant.", "Give back a fixed number."]
    (tmp_path / "consts.py").write_text("".join(
        f"def c{i}():\n    '''{docs[i % 2]}'''\n    return {i}\n\n" for i in range(40)))
    corpus = build_codegen_corpus([tmp_path], direction=direction, use_cache=False)
    doc_column = "source" if direction == "doc2code" else "target"
    for split in SPLITS:
        for doc in corpus[split][doc_column]:
            assert split_of(doc) == split  # independent: the split of the docstring's own hash
    assert sum(len(corpus[split]) for split in SPLITS) == 40


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def _private_datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def test_hub_corpus_from_a_local_dataset_folder_maps_columns_and_fills_missing_splits(tmp_path, _private_datasets_cache):
    from flexformers.training_scripts.data import load_hub_corpus

    rows = [{"en": f"hello {i}", "de": f"hallo {i}"} for i in range(20)]
    folder = write_jsonl(tmp_path / "corpus" / "train.jsonl", rows).parent
    corpus = load_hub_corpus(str(folder), None, "en", "de")
    assert set(corpus) == {"train", "validation", "test"}
    assert len(corpus["train"]) == 18 and len(corpus["validation"]) == 2
    assert list(corpus["test"]["source"]) == list(corpus["validation"]["source"])  # no test split: reuses validation
    pairs = {(r["source"], r["target"]) for split in ("train", "validation") for r in corpus[split]}
    assert pairs == {(r["en"], r["de"]) for r in rows}


def test_hub_corpus_translation_column_and_dev_split(tmp_path, _private_datasets_cache):
    from flexformers.training_scripts.data import load_hub_corpus

    folder = tmp_path / "wmt"
    write_jsonl(folder / "train.jsonl", [{"translation": {"en": f"cat {i}", "de": f"Katze {i}"}} for i in range(5)])
    write_jsonl(folder / "dev.jsonl", [{"translation": {"en": "dog", "de": "Hund"}}])
    corpus = load_hub_corpus(str(folder), source_lang="en", target_lang="de")
    assert list(corpus["train"]["source"]) == [f"cat {i}" for i in range(5)]
    assert list(corpus["validation"]["target"]) == ["Hund"] and list(corpus["test"]["target"]) == ["Hund"]
    with pytest.raises(ValueError, match="not en/fr"):
        load_hub_corpus(str(folder), source_lang="en", target_lang="fr")


def test_load_corpus_dispatches_word_order_files_and_hub(tmp_path, _private_datasets_cache):
    from flexformers.training_scripts.arguments import DataArguments
    from flexformers.training_scripts.data import load_corpus

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text(
        "def add(a, b):\n    '''Add the two given numbers together.'''\n    return a + b\n")
    word_order = load_corpus(DataArguments(task="word_order", python_source_dirs=[str(tmp_path / "src")]))
    assert [r["target"] for split in SPLITS for r in word_order[split]] == ["Add the two given numbers together."]
    folder = write_jsonl(tmp_path / "hub" / "train.jsonl", [{"source": f"s{i}", "target": f"t{i}"} for i in range(10)]).parent
    hub = load_corpus(DataArguments(task="hub", dataset_name=str(folder)))
    assert sorted(list(hub["train"]["source"]) + list(hub["validation"]["source"])) == sorted(f"s{i}" for i in range(10))
    train_file = write_jsonl(tmp_path / "train.jsonl", [{"source": "a", "target": "b"}])
    files = load_corpus(DataArguments(task="files", train_file=str(train_file), validation_file=str(train_file)))
    assert list(files["train"]["target"]) == ["b"] and list(files["test"]["target"]) == ["b"]


def test_hub_corpus_not_reachable_offline_is_one_clear_error_naming_it(tmp_path, monkeypatch, _private_datasets_cache):
    import datasets
    import huggingface_hub

    from flexformers.training_scripts.data import load_hub_corpus

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    # a ValueError, so flexformers-train prints one line instead of a ConnectionError traceback
    with pytest.raises(ValueError, match=r"nobody-flexformers/no-such-corpus.*offline"):
        load_hub_corpus("nobody-flexformers/no-such-corpus")


# Round 2 mutation survivors (issue 65)
def test_split_ratios_other_than_80_10_10_give_each_split_its_own_share(tmp_path):
    keys = [f"example {i}" for i in range(20000)]
    splits = [split_of(key, (60, 30, 10)) for key in keys]
    assert abs(splits.count("train") / len(keys) - 0.6) < 0.02
    assert abs(splits.count("validation") / len(keys) - 0.3) < 0.02
    assert abs(splits.count("test") / len(keys) - 0.1) < 0.015
    for ratios, only in (((1, 0, 0), "train"), ((0, 1, 0), "validation"), ((0, 0, 1), "test")):
        assert {split_of(key, ratios) for key in keys[:200]} == {only}
    # the builders pass their ratios on: a corpus with no train or test share is all validation
    (tmp_path / "d.tsv").write_text("".join(f"s{i}\tt{i}\n" for i in range(30)))
    corpus = load_parallel_files(tmp_path / "d.tsv", source_column="0", target_column="1", ratios=(0, 1, 0))
    assert (len(corpus["train"]), len(corpus["validation"]), len(corpus["test"])) == (0, 30, 0)


def test_codegen_file_scan_skips_are_logged_under_their_own_name(tmp_path, caplog):
    (tmp_path / "ok.py").write_text("def add(a, b):\n    '''Add two numbers.'''\n    return a + b\n")
    (tmp_path / "gone.py").symlink_to(tmp_path / "deleted.py")
    build_codegen_corpus([tmp_path], use_cache=False)
    assert (f"codegen corpus file scan: skipped {{'dangling symlink': 1}} (first: dangling symlink: "
            f"{tmp_path / 'gone.py'})") in caplog.text


def test_gettext_corpus_is_cached_by_default_and_rebuilt_when_a_catalog_changes(tmp_path):
    mo = write_mo(tmp_path / "app.mo", {"Open file": "Datei öffnen"})
    first = build_gettext_corpus(catalog_files=[mo])
    cached = sorted(p.name for p in (tmp_path / "cache" / "corpora").iterdir())
    assert len(cached) == 1 and cached[0].startswith("gettext-en-de-")
    again = build_gettext_corpus(catalog_files=[mo])
    assert sorted(p.name for p in (tmp_path / "cache" / "corpora").iterdir()) == cached  # read back, not rebuilt
    assert [r["target"] for s in SPLITS for r in again[s]] == [r["target"] for s in SPLITS for r in first[s]]
    write_mo(mo, {"Open file": "Datei öffnen", "Close the window": "Fenster schließen"})
    changed = build_gettext_corpus(catalog_files=[mo])
    assert sorted(r["target"] for s in SPLITS for r in changed[s]) == ["Datei öffnen", "Fenster schließen"]
    assert len(list((tmp_path / "cache" / "corpora").iterdir())) == 2


def test_gettext_drops_a_pair_when_either_side_is_only_format_specifiers(tmp_path):
    mo = write_mo(tmp_path / "app.mo", {
        "File: %s": "%s",  # the translation holds no words: nothing to learn from it
        "%d": "Nummer %d",  # the English holds no words
        "<b>%s</b>": "{0}",  # neither does
        "Save %s": "%s speichern",
    })
    corpus = build_gettext_corpus(catalog_files=[mo], use_cache=False)
    assert [(r["source"], r["target"]) for s in SPLITS for r in corpus[s]] == [("Save %s", "%s speichern")]


def test_load_corpus_passes_the_codegen_options_on(tmp_path):
    from flexformers.training_scripts.arguments import DataArguments
    from flexformers.training_scripts.data import load_corpus

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text(
        "def add(a, b):\n    '''Add two numbers.\n\n    Both must be numbers.'''\n    return a + b\n\n"
        "def sub(a, b):\n    '''Subtract the second number from the first one, a rather long summary.'''\n"
        "    return a - b\n")
    src = [str(tmp_path / "src")]

    def pairs(**options):
        corpus = load_corpus(DataArguments(python_source_dirs=src, **options))
        return sorted((r["source"], r["target"]) for s in SPLITS for r in corpus[s])

    assert pairs(task="codegen") == [
        ("Add two numbers. Both must be numbers.", "def add(a, b):\n    return a + b"),
        ("Subtract the second number from the first one, a rather long summary.", "def sub(a, b):\n    return a - b")]
    assert pairs(task="codegen", docstring="summary", max_source_chars=30) == [
        ("Add two numbers.", "def add(a, b):\n    return a + b")]
    with pytest.raises(ValueError, match="No documented functions"):  # both functions are longer than 25 chars
        pairs(task="code2doc", max_target_chars=25)
    assert pairs(task="code2doc", docstring="summary") == [
        ("def add(a, b):\n    return a + b", "Add two numbers."),
        ("def sub(a, b):\n    return a - b", "Subtract the second number from the first one, a rather long summary.")]


def test_hub_corpus_without_the_named_columns_is_one_error_naming_them_and_the_columns_it_has(
        tmp_path, _private_datasets_cache):
    from flexformers.training_scripts.data import load_hub_corpus

    folder = write_jsonl(tmp_path / "corpus" / "train.jsonl", [{"en": f"hello {i}", "de": f"hallo {i}"}
                                                               for i in range(5)]).parent
    with pytest.raises(ValueError, match=r"\[train\] has no column\(s\) \['source', 'target'\] \(columns: "
                                         r"\['en', 'de'\]\)"):
        load_hub_corpus(str(folder))
    with pytest.raises(ValueError, match=r"\[train\] has no column\(s\) \['fr'\]"):
        load_hub_corpus(str(folder), None, "en", "fr", source_lang="en", target_lang="fr")


def test_bad_lines_skipped_in_every_file_are_summed_in_one_warning(tmp_path, caplog):
    (tmp_path / "train.tsv").write_bytes(b"source\ttarget\nok\tgut\nB\xe4r\tbear\nfine\tfein\n")
    (tmp_path / "valid.tsv").write_bytes(b"source\ttarget\nyes\tja\nlonely\n\tno source\n")
    load_parallel_files(tmp_path / "train.tsv", validation_file=tmp_path / "valid.tsv", skip_bad_lines=True)
    warnings = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith("parallel files: skipped {'not valid UTF-8 (byte 1': 1, 'missing column': 1, "
                                  "'empty source field': 1} (first: not valid UTF-8 (byte 1: ")


@pytest.mark.parametrize("name, content, columns, line", [
    ("excel.csv", "source,target\r\nHello,Hallo\r\n", ("source", "target"), 2),
    ("notepad.tsv", "source\ttarget\nHello\tHallo\n", ("source", "target"), 2),
    ("plain.tsv", "Hello\tHallo\n", ("0", "1"), 1),
    ("lines.jsonl", '{"source": "Hello", "target": "Hallo"}\n', ("source", "target"), 1),
])
def test_a_byte_order_mark_at_the_start_of_a_file_is_not_part_of_the_first_field(tmp_path, name, content, columns,
                                                                                 line):
    (tmp_path / name).write_bytes("\ufeff".encode() + content.encode())  # as Excel and Notepad save UTF-8
    rows = read_parallel_file(tmp_path / name, *columns)
    assert [(r["source"], r["target"], r["origin"]) for r in rows] == [("Hello", "Hallo", f"{name}:{line}")]


def test_read_text_lines_strips_line_ends_and_names_a_line_that_is_not_utf8(tmp_path):
    from flexformers.training_scripts.data import read_text_lines

    (tmp_path / "in.txt").write_bytes("first\r\nsecond  \n\nGrüße".encode())
    assert read_text_lines(tmp_path / "in.txt") == ["first", "second  ", "", "Grüße"]
    (tmp_path / "latin.txt").write_bytes(b"ok\nB\xe4r\n")
    with pytest.raises(ValueError, match=r"latin.txt, line 2: not valid UTF-8 \(byte 1\)"):
        read_text_lines(tmp_path / "latin.txt")


def test_load_corpus_passes_the_translation_files_and_hub_options_on(tmp_path, _private_datasets_cache):
    from flexformers.training_scripts.arguments import DataArguments
    from flexformers.training_scripts.data import load_corpus

    (tmp_path / "locale" / "xx" / "LC_MESSAGES").mkdir(parents=True)
    write_mo(tmp_path / "locale" / "xx" / "LC_MESSAGES" / "app.mo", {"Open the file now": "Öffne die Datei jetzt"})
    translation = load_corpus(DataArguments(task="translation", target_lang="xx", locale_dir=str(tmp_path / "locale")))
    assert [(r["source"], r["target"]) for s in SPLITS for r in translation[s]] == [
        ("Open the file now", "Öffne die Datei jetzt")]
    word_order = load_corpus(DataArguments(task="word_order", word_order_base="gettext", target_lang="xx",
                                           locale_dir=str(tmp_path / "locale")))
    assert [r["target"] for s in SPLITS for r in word_order[s]] == ["Open the file now"]

    (tmp_path / "pairs.txt").write_bytes(b"id,en,de\n1,yes,ja\n2,B\xe4r\n3,no,nein\n")  # line 3 is not UTF-8
    files = load_corpus(DataArguments(task="files", train_file=str(tmp_path / "pairs.txt"),
                                      validation_file=str(tmp_path / "pairs.txt"), file_format="csv",
                                      source_column="en", target_column="de", skip_bad_lines=True))
    assert [(r["source"], r["target"]) for r in files["train"]] == [("yes", "ja"), ("no", "nein")]

    rows = [{"en": f"cat {i}", "de": f"Katze {i}"} for i in range(10)]
    folder = write_jsonl(tmp_path / "hub" / "train.jsonl", rows).parent
    hub = load_corpus(DataArguments(task="hub", dataset_name=str(folder), source_column="en", target_column="de"))
    assert sorted((r["source"], r["target"]) for s in ("train", "validation") for r in hub[s]) == sorted(
        (f"cat {i}", f"Katze {i}") for i in range(10))


# ---- issue 65, round 3: the held-out sample's (seed 2) survivors ----


@pytest.mark.parametrize("split_name", ["valid", "dev"])
def test_a_hub_corpus_whose_split_is_named_valid_or_dev_is_the_validation_split(monkeypatch, split_name):
    """Hub datasets name their validation split "valid" or "dev" as often as "validation" (a dataset's own configs
    decide, not the file names): both become the corpus' validation split, and the test split stays its own."""
    import datasets

    from flexformers.training_scripts.data import load_hub_corpus

    def split(prefix, count):
        return datasets.Dataset.from_dict({"source": [f"{prefix} {i}" for i in range(count)],
                                           "target": [f"{prefix}-t {i}" for i in range(count)]})

    raw = datasets.DatasetDict({"train": split("train", 6), split_name: split("held", 2), "test": split("test", 3)})
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config_name=None: raw)
    corpus = load_hub_corpus("someone/corpus")
    assert set(corpus) == {"train", "validation", "test"}
    assert list(corpus["validation"]["source"]) == ["held 0", "held 1"]
    assert list(corpus["test"]["source"]) == ["test 0", "test 1", "test 2"]


@pytest.mark.parametrize("line, problem", [(b"a\tb\tc\n", "too many fields"), (b"a\n", "missing column")])
def test_a_line_with_the_wrong_number_of_fields_is_named_by_its_line_number(tmp_path, line, problem):
    """The error (and, when skipping, the report) names the offending line's number, not only the file."""
    from flexformers.training_scripts.data import SkipReport

    path = tmp_path / "pairs.tsv"
    path.write_bytes(b"source\ttarget\nok\tgut\nfine\tfein\n" + line + b"last\tletzte\n")
    with pytest.raises(ValueError, match=rf"pairs.tsv, line 4: {problem}"):
        read_parallel_file(path)
    report = SkipReport()
    rows = read_parallel_file(path, skip_bad_lines=True, report=report)
    assert [row["origin"] for row in rows] == ["pairs.tsv:2", "pairs.tsv:3", "pairs.tsv:5"]
    assert report.examples == [f"{problem}: {path}:4"]


def test_corpus_builders_report_duplicates_and_over_long_pairs_by_name(tmp_path, caplog):
    """The skip report names why pairs were dropped, under the reasons the docs list: duplicates and the length cap
    (gettext catalogs and code alike)."""
    import logging

    long_text = "word " * 30
    mo = write_mo(tmp_path / "app.mo", {"Open file": "Datei öffnen", long_text: long_text, "Close": "Schließen"})
    copy = write_mo(tmp_path / "copy.mo", {"Open file": "Datei öffnen", "Quit": "Beenden"})
    with caplog.at_level(logging.WARNING):
        build_gettext_corpus(catalog_files=[mo, copy], use_cache=False, max_chars=100)
    assert "'over length cap': 1" in caplog.text and "'duplicate': 1" in caplog.text
    caplog.clear()
    body = "def f(x):\n    '''Double it.'''\n    return 2 * x\n"
    (tmp_path / "a.py").write_text(body + "\n\n" + body.replace("f(x)", "g(x)").replace("2 * x", "x" * 300))
    (tmp_path / "b.py").write_text(body)
    with caplog.at_level(logging.WARNING):
        build_codegen_corpus([tmp_path], use_cache=False, max_target_chars=100)
    assert "'over length cap': 1" in caplog.text and "'duplicate': 1" in caplog.text


# Round 4 of the mutation score (docs/MUTATION.md): what seed 3's survivors in data.py showed untested.


def test_a_cache_write_leaves_the_users_progress_bar_setting_as_it_found_it(tmp_path):
    """The cache write silences datasets' "Saving the dataset" bars for itself only: a user who had them on keeps
    them on, one who had them off keeps them off."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    try:
        for cache, user_disabled in (("on", False), ("off", True)):
            datasets.disable_progress_bars() if user_disabled else datasets.enable_progress_bars()
            build_codegen_corpus(REAL_PY_FILES[:1], cache_dir=tmp_path / cache)
            assert any((tmp_path / cache).iterdir())  # the cache write (and its bar switching) did happen
            assert datasets.are_progress_bars_disabled() is user_disabled
    finally:
        datasets.disable_progress_bars() if was_disabled else datasets.enable_progress_bars()


def test_the_codegen_cache_is_not_reused_when_the_source_length_cap_changes(tmp_path):
    """max_source_chars is part of the cache key: a stricter cap on a second build must not return the first build's
    rows from the cache."""
    loose = build_codegen_corpus(REAL_PY_FILES, cache_dir=tmp_path / "c", max_source_chars=1024)
    strict = build_codegen_corpus(REAL_PY_FILES, cache_dir=tmp_path / "c", max_source_chars=60)
    loose_rows = [row for split in loose.values() for row in split]
    strict_rows = [row for split in strict.values() for row in split]
    assert 0 < len(strict_rows) < len(loose_rows)
    assert all(len(row["source"]) <= 60 for row in strict_rows)
    assert any(len(row["source"]) > 60 for row in loose_rows)


PINNED_HUB_VALIDATION_ROWS = ["hello 11", "hello 24", "hello 27", "hello 4"]  # datasets' split with seed 0


def test_a_hub_corpus_without_validation_split_draws_the_same_rows_on_every_machine(tmp_path, _private_datasets_cache):
    """The held-out tenth is drawn with a fixed seed, so two machines (and the zoo's records) score the same rows:
    the rows are pinned here, not only their count."""
    from flexformers.training_scripts.data import load_hub_corpus

    rows = [{"en": f"hello {i}", "de": f"hallo {i}"} for i in range(40)]
    folder = write_jsonl(tmp_path / "corpus" / "train.jsonl", rows).parent
    corpus = load_hub_corpus(str(folder), None, "en", "de")
    assert sorted(corpus["validation"]["source"]) == PINNED_HUB_VALIDATION_ROWS


def test_a_fifo_given_as_a_data_file_is_named_not_a_regular_file(tmp_path):
    """A FIFO would block the read forever: it is refused by name, not as a missing file."""
    import os

    os.mkfifo(tmp_path / "pairs.tsv")
    with pytest.raises(ValueError, match=r"pairs.tsv: not a regular file"):
        read_parallel_file(tmp_path / "pairs.tsv")


# ---------------------------------------------------------------------------------------------------- round 5
def test_a_json_extension_reads_as_json_lines(tmp_path):
    """``.json`` is sniffed as JSON lines, like ``.jsonl`` (a file exported as one object a line)."""
    (tmp_path / "pairs.json").write_text('{"source": "Yes", "target": "Ja"}\n{"source": "No", "target": "Nein"}\n')
    rows = read_parallel_file(tmp_path / "pairs.json")
    assert [(r["source"], r["target"]) for r in rows] == [("Yes", "Ja"), ("No", "Nein")]


def test_a_docstring_exactly_at_the_source_cap_is_kept(tmp_path):
    """The cap is a maximum: a docstring of exactly ``max_source_chars`` characters is kept, one more is dropped."""
    (tmp_path / "m.py").write_text("def f(x):\n    '''Doubles x.'''\n    return 2 * x\n\n\n"
                                   "def g(x):\n    '''Triples x!!'''\n    return 3 * x\n")
    corpus = build_codegen_corpus([tmp_path], use_cache=False, max_source_chars=len("Doubles x."))
    assert [row["source"] for split in corpus.values() for row in split] == ["Doubles x."]


def test_gettext_skip_report_names_empty_and_format_only_entries(tmp_path, caplog):
    """The log says why entries were dropped, under the reasons the builder's docstring lists."""
    import logging

    mo = write_mo(tmp_path / "app.mo", {"Open file": "Datei öffnen", "%s: %s": "%s: %s", "Untranslated": ""})
    with caplog.at_level(logging.WARNING):
        build_gettext_corpus(catalog_files=[mo], use_cache=False)
    assert "'empty': 1" in caplog.text and "'format-only': 1" in caplog.text


def test_gettext_reads_the_system_locale_folder_by_default():
    """Without ``locale_dir`` the catalogs come from ``/usr/share/locale`` (where Debian installs them)."""
    with pytest.raises(ValueError, match="/usr/share/locale/xx-none/LC_MESSAGES does not exist"):
        build_gettext_corpus("xx-none")


def test_english_sentences_keeps_four_words_in_five_and_reads_on_after_a_rejected_one():
    """A sentence is kept when at least 80% of its words have letters (4 of 5 exactly is enough), and a rejected
    sentence does not end the scan of the text."""
    from flexformers.training_scripts.data import english_sentences

    text = "Numbers 1 2 3 4 here. Keep the 5 items here. Then read this one too."
    assert list(english_sentences([text], min_words=4, max_words=30)) == [
        "Keep the 5 items here.", "Then read this one too."]


def test_a_txt_file_is_tab_separated_and_keeps_its_first_letter_after_a_bom_and_its_unterminated_last_line(tmp_path):
    """A `.txt` file is read as TSV; only the byte-order mark goes from the first line (not a leading letter), and a
    last line without a newline is a record even when a blank line comes before it."""
    path = tmp_path / "pairs.txt"
    path.write_bytes("\ufeffXylophone\tXylofon\n\nYes\tJa".encode())
    rows = read_parallel_file(path, "0", "1")
    assert [(row["source"], row["target"], row["origin"]) for row in rows] == [
        ("Xylophone", "Xylofon", "pairs.txt:1"), ("Yes", "Ja", "pairs.txt:3")]


def test_codegen_cache_is_keyed_on_the_target_length_cap_and_on_strictness(tmp_path):
    """A cached corpus is reused only for the same options: a smaller `max_target_chars` drops the long function, and
    `strict=True` refuses the unparseable file even after a lenient build of the same folder was cached."""
    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "a.py").write_text("def short(x):\n    '''Short one.'''\n    return x\n\n\n"
                                  "def long(x):\n    '''Long one.'''\n    return " + "x + " * 60 + "x\n")
    cache = tmp_path / "cache-dir"
    every = build_codegen_corpus([sources], cache_dir=cache)
    assert sorted(row["source"] for split in every.values() for row in split) == ["Long one.", "Short one."]
    capped = build_codegen_corpus([sources], cache_dir=cache, max_target_chars=100)
    assert [row["source"] for split in capped.values() for row in split] == ["Short one."]
    (sources / "broken.py").write_text("def f(:\n    pass\n")
    build_codegen_corpus([sources], cache_dir=cache)
    with pytest.raises(ValueError, match="broken.py: cannot parse"):
        build_codegen_corpus([sources], cache_dir=cache, strict=True)


# ---- issue 65, round 8: the held-out sample's (seed 6) survivors


def test_train_and_test_files_without_a_validation_file_validate_on_the_test_file(tmp_path):
    (tmp_path / "train.tsv").write_text("source\ttarget\nHello\tHallo\nGood day\tGuten Tag\n")
    (tmp_path / "test.tsv").write_text("source\ttarget\nYes\tJa\n")
    corpus = load_parallel_files(tmp_path / "train.tsv", test_file=tmp_path / "test.tsv")
    assert corpus["validation"]["source"] == corpus["test"]["source"] == ["Yes"]
    assert corpus["train"]["source"] == ["Hello", "Good day"]


@pytest.mark.parametrize("name, header", [("twice.csv", "source,source,target"), ("twice.tsv", "source\ttarget\ttarget")])
def test_a_header_that_names_a_column_twice_is_refused(tmp_path, name, header):
    """Which of two equally named columns is meant cannot be told: taking the first could train on the wrong text."""
    separator = "," if name.endswith(".csv") else "\t"
    (tmp_path / name).write_text(header + "\n" + separator.join("abc") + "\n")
    column = header.split(separator)[1]
    with pytest.raises(ValueError, match=f"{name}, line 1: the header names column '{column}' twice"):
        read_parallel_file(tmp_path / name)


def test_a_line_that_is_not_utf8_names_the_offending_byte(tmp_path):
    (tmp_path / "latin.tsv").write_bytes(b"source\ttarget\nok\tgut\nB\xe4r\tbear\n")
    with pytest.raises(ValueError, match=r"latin.tsv, line 3: not valid UTF-8 \(byte 1: b'\\xe4'\)"):
        read_parallel_file(tmp_path / "latin.tsv")


# ---- issue 65, round 9: the held-out data.py sample's (seed 7) survivors


def test_gettext_keeps_a_pair_exactly_at_the_length_cap_on_either_side(tmp_path):
    """`max_chars` is the longest text kept (as the code corpus' caps): a source or target of exactly that many
    characters stays, one more is dropped."""
    mo = write_mo(tmp_path / "app.mo", {"Open the file": "Datei öffnen", "Close it": "Das Fenster jetzt schließen",
                                        "Open the files": "Dateien öffnen"})
    corpus = build_gettext_corpus(catalog_files=[mo], max_chars=len("Open the file"), use_cache=False)
    kept = sorted(r["source"] for split in corpus.values() for r in split)
    assert kept == ["Open the file"]  # 13 characters; "Open the files" (14) and a 27-character target are dropped
    corpus = build_gettext_corpus(catalog_files=[mo], max_chars=len("Das Fenster jetzt schließen"), use_cache=False)
    assert sorted(r["source"] for split in corpus.values() for r in split) == ["Close it", "Open the file",
                                                                               "Open the files"]
