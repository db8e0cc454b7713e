"""Nothing lost, nothing silently wrong around decoding, data files and the method tools (issue 60): decode scores
the training run's own data files wherever it runs, ``--do_predict`` keeps one output per test pair, decode never
overwrites a file it did not write, the method tools refuse another type's model in one line, data-file edge cases
are named, and ``generate()`` names an out-of-vocabulary ``decoder_start_token_id``. Each test reproduces a probe
that failed before the fix."""

import hashlib
import io
import json
import logging
import os
import re
import shutil
import types
from pathlib import Path

import pytest
import torch

from flexformers.training_scripts import decode, depth_adaptive_tools, indigo_trace, iot_order_analysis, train
from flexformers.training_scripts.arguments import DATA_ARGS_FILE, DataArguments
from flexformers.training_scripts.data import read_parallel_file

from .test_metric_values import WordTokenizer  # one id per word: the lookup-table model's tokenizer
from .test_reliability import _tiny_models, model_dir  # noqa: F401 (a module-scoped fixture: an untrained baseline)
from .test_training import tiny_argv


@pytest.fixture(autouse=True)
def _offline_private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FLEXFORMERS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def write_pairs(path: Path, pairs) -> Path:
    path.write_text("source\ttarget\n" + "".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
    return path


TRAIN_PAIRS = [(f"open the file number {i}", f"read line {i * 7}") for i in range(12)]
TEST_PAIRS = [(f"read line {i}", f"open the file {i}") for i in range(3)]
OTHER_TEST_PAIRS = [(f"and read the file {i}", f"line number {i}") for i in range(5)]


@pytest.fixture
def run_elsewhere(model_dir, tmp_path, monkeypatch):  # noqa: F811
    """(run, training_dir, elsewhere): a model whose data arguments were saved with the relative paths
    ``train.tsv`` / ``test.tsv`` of ``training_dir``; the current directory is now ``elsewhere``, which holds
    another ``test.tsv`` (5 pairs against the training run's 3)."""
    run = tmp_path / "run"
    shutil.copytree(model_dir, run)
    training_dir, elsewhere = tmp_path / "training", tmp_path / "elsewhere"
    training_dir.mkdir()
    elsewhere.mkdir()
    write_pairs(training_dir / "train.tsv", TRAIN_PAIRS)
    write_pairs(training_dir / "test.tsv", TEST_PAIRS)
    write_pairs(elsewhere / "train.tsv", TRAIN_PAIRS)
    write_pairs(elsewhere / "test.tsv", OTHER_TEST_PAIRS)
    monkeypatch.chdir(training_dir)
    DataArguments(task="files", train_file="train.tsv", test_file="test.tsv", max_source_length=30,
                  max_target_length=30).save(run)
    monkeypatch.chdir(elsewhere)
    return run, training_dir, elsewhere


DECODE = ["--num_beams", "1", "--max_new_tokens", "2", "--num_samples_to_print", "0"]


# ------------------------------------------------------------------------------ 1. the run's own data files
def test_decode_scores_the_training_runs_test_file_wherever_it_runs(run_elsewhere):
    run, training_dir, _ = run_elsewhere
    saved = json.loads((run / DATA_ARGS_FILE).read_text())
    assert saved["train_file"] == str(training_dir / "train.tsv")
    assert saved["test_file"] == str(training_dir / "test.tsv")
    expected = hashlib.sha256((training_dir / "test.tsv").read_bytes()).hexdigest()
    assert saved["data_file_sha256"]["test_file"] == expected
    assert saved["data_file_sha256"]["validation_file"] is None
    results = decode.run_from_argv(["--model_name_or_path", str(run), *DECODE])
    assert results["num_examples"] == len(TEST_PAIRS)  # the cwd's test.tsv has 5
    rows = [json.loads(line) for line in (run / "generations.test.jsonl").read_text().splitlines()]
    assert [(row["index"], row["origin"], row["source"]) for row in rows] == [
        (index, f"test.tsv:{index + 2}", source) for index, (source, _) in enumerate(TEST_PAIRS)]
    report = json.loads((run / "eval_results.json").read_text())
    assert report["num_examples"] == len(TEST_PAIRS) and report["data_files_changed"] == {}


def test_a_changed_data_file_is_named_in_one_warning_and_in_eval_results(run_elsewhere, caplog):
    run, training_dir, _ = run_elsewhere
    write_pairs(training_dir / "test.tsv", TEST_PAIRS[:2])
    with caplog.at_level(logging.WARNING):
        results = decode.run_from_argv(["--model_name_or_path", str(run), *DECODE])
    assert results["num_examples"] == 2
    changed = [r.getMessage() for r in caplog.records if "changed since training" in r.getMessage()]
    assert len(changed) == 1 and str(training_dir / "test.tsv") in changed[0] and "\n" not in changed[0]
    report = json.loads((run / "eval_results.json").read_text())
    assert report["data_files_changed"] == {"test_file": str(training_dir / "test.tsv")}


def test_an_explicit_test_file_is_read_from_the_current_directory(run_elsewhere, caplog):
    run, _, _ = run_elsewhere
    with caplog.at_level(logging.WARNING):
        results = decode.run_from_argv(["--model_name_or_path", str(run), "--test_file", "test.tsv", *DECODE])
    assert results["num_examples"] == len(OTHER_TEST_PAIRS)
    assert not [r for r in caplog.records if "changed since training" in r.getMessage()]


def test_data_arguments_saved_without_hashes_still_load(run_elsewhere, monkeypatch, caplog):
    run, training_dir, _ = run_elsewhere
    old = json.loads((run / DATA_ARGS_FILE).read_text())
    old.pop("data_file_sha256")
    old.update(train_file="train.tsv", test_file="test.tsv")  # as older versions wrote them
    (run / DATA_ARGS_FILE).write_text(json.dumps(old))
    monkeypatch.chdir(training_dir)
    with caplog.at_level(logging.WARNING):
        results = decode.run_from_argv(["--model_name_or_path", str(run), *DECODE])
    assert results["num_examples"] == len(TEST_PAIRS)
    relative = [r.getMessage() for r in caplog.records if "relative paths" in r.getMessage()]
    assert len(relative) == 1 and "--test_file test.tsv" in relative[0] and str(training_dir) in relative[0]


def test_a_data_file_of_the_run_that_is_gone_is_named(run_elsewhere, capsys):
    run, training_dir, _ = run_elsewhere
    (training_dir / "test.tsv").unlink()
    assert decode.main(["--model_name_or_path", str(run), *DECODE]) == 1
    error = one_error_line(capsys)
    assert f"the training run's --test_file {training_dir / 'test.tsv'} is gone" in error


def test_a_test_split_that_is_the_validation_file_is_said(run_elsewhere, caplog):
    run, training_dir, _ = run_elsewhere
    DataArguments(task="files", train_file=str(training_dir / "train.tsv"),
                  validation_file=str(training_dir / "test.tsv")).save(run)
    with caplog.at_level(logging.WARNING):
        decode.run_from_argv(["--model_name_or_path", str(run), *DECODE])
    said = [r.getMessage() for r in caplog.records if "no --test_file" in r.getMessage()]
    assert len(said) == 1 and str(training_dir / "test.tsv") in said[0]


def test_resuming_with_another_train_file_warns_naming_both(tmp_path, monkeypatch, caplog):
    first = write_pairs(tmp_path / "train.tsv", TRAIN_PAIRS)
    second = write_pairs(tmp_path / "train2.tsv", TRAIN_PAIRS[::-1] + [("close the window", "shut it")])
    out = tmp_path / "run"
    common = ("--task", "files", "--save_strategy", "steps", "--save_steps", "1", "--vocab_size", "270")
    train.run_from_argv(tiny_argv(out, *common, "--train_file", str(first), "--max_steps", "1"))
    with caplog.at_level(logging.WARNING):
        train.run_from_argv(tiny_argv(out, *common, "--train_file", str(second), "--max_steps", "2",
                                      "--resume_from_checkpoint", "latest"))
    warnings = [r.getMessage() for r in caplog.records if "--train_file" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(first) in warnings[0] and str(second) in warnings[0]
    caplog.clear()
    write_pairs(second, TRAIN_PAIRS)  # same path, other content
    with caplog.at_level(logging.WARNING):
        train.run_from_argv(tiny_argv(out, *common, "--train_file", str(second), "--max_steps", "3",
                                      "--resume_from_checkpoint", "latest"))
    warnings = [r.getMessage() for r in caplog.records if "--train_file" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(second) in warnings[0] and "changed" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the same file again: no warning
        train.run_from_argv(tiny_argv(out, *common, "--train_file", str(second), "--max_steps", "4",
                                      "--resume_from_checkpoint", "latest"))
    assert not [r for r in caplog.records if "--train_file" in r.getMessage() and r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------------ 2. --do_predict keeps every pair
def test_do_predict_writes_one_line_per_test_pair_in_order_scored_on_whole_references(tmp_path, caplog):
    from flexformers.training_scripts.metrics_utils import compute_generation_metrics

    long_source = " ".join(f"word{i}" for i in range(150))
    long_reference = " ".join(f"line{i}" for i in range(150))
    test_pairs = [TEST_PAIRS[0], (long_source, "open it"), ("read it", long_reference), TEST_PAIRS[1]]
    write_pairs(tmp_path / "train.tsv", TRAIN_PAIRS)
    write_pairs(tmp_path / "test.tsv", test_pairs)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        results = train.run_from_argv(tiny_argv(
            out, "--task", "files", "--train_file", str(tmp_path / "train.tsv"), "--validation_file",
            str(tmp_path / "train.tsv"), "--test_file", str(tmp_path / "test.tsv"), "--do_predict",
            "--max_steps", "1", "--save_strategy", "no", "--vocab_size", "270", "--generation_max_length", "4"))
    rows = [json.loads(line) for line in (out / "test_generations.jsonl").read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(len(test_pairs)))
    assert [(row["source"], row["reference"]) for row in rows] == test_pairs
    assert [row["origin"] for row in rows] == [f"test.tsv:{line}" for line in range(2, 6)]
    assert results["test"]["test_samples"] == len(test_pairs)
    expected = compute_generation_metrics([row["hypothesis"] for row in rows], [t for _, t in test_pairs])
    assert results["test"]["test_bleu"] == pytest.approx(round(expected["bleu"], 4))
    assert results["test"]["test_chrf"] == pytest.approx(round(expected["chrf"], 4))
    cut = [r.getMessage() for r in caplog.records if "--max_source_length" in r.getMessage()]
    assert len(cut) == 1 and "1 of the 4 test sources" in cut[0]


# ------------------------------------------------------------------------------ 3. decode's output files
@pytest.fixture
def no_decoding(monkeypatch):
    """Decoding fails the test: a refusal must come before the work."""
    def refuse(*args, **kwargs):
        raise AssertionError("decoded before refusing")

    monkeypatch.setattr(decode, "generate_texts", refuse)


def one_error_line(capsys, tool="flexformers-decode") -> str:
    """The one line the tool printed on stderr (progress bars of loading aside)."""
    error = capsys.readouterr().err
    lines = [line for line in error.splitlines() if line.strip() and "%|" not in line]
    assert "Traceback" not in error and len(lines) == 1, error
    assert lines[0].startswith(f"{tool}: error: "), error
    return lines[0]


@pytest.mark.parametrize("name", ["test.tsv", "train.tsv"])
def test_decode_refuses_to_write_over_a_data_file(run_elsewhere, capsys, no_decoding, name):
    run, training_dir, _ = run_elsewhere
    data = training_dir / name
    before = data.read_bytes()
    for extra in ([], ["--overwrite_output"]):
        assert decode.main(["--model_name_or_path", str(run), "--output_file", str(data), *extra, *DECODE]) == 1
        assert "is the training run's" in one_error_line(capsys) and data.read_bytes() == before


def test_decode_refuses_a_hypotheses_file_whose_jsonl_is_a_data_file(run_elsewhere, capsys, no_decoding):
    run, training_dir, _ = run_elsewhere
    data = training_dir / "pairs.jsonl"
    data.write_text('{"source": "read line 1", "target": "open the file 1"}\n')
    DataArguments(task="files", train_file=str(training_dir / "train.tsv"), test_file=str(data)).save(run)
    assert decode.main(["--model_name_or_path", str(run), "--output_file", str(training_dir / "pairs.txt"),
                        "--overwrite_output", *DECODE]) == 1
    assert "pairs.jsonl" in one_error_line(capsys)
    assert not (training_dir / "pairs.txt").exists()


def test_decode_refuses_an_existing_output_file_unless_told_to_overwrite(run_elsewhere, tmp_path, capsys):
    run, _, _ = run_elsewhere
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    assert decode.main(["--model_name_or_path", str(run), "--output_file", str(mine), *DECODE]) == 1
    assert "--overwrite_output" in one_error_line(capsys) and mine.read_text() == "my notes\n"
    sibling = tmp_path / "hyps.jsonl"
    sibling.write_text("my other notes\n")
    assert decode.main(["--model_name_or_path", str(run), "--output_file", str(tmp_path / "hyps.txt"), *DECODE]) == 1
    assert "hyps.jsonl" in one_error_line(capsys) and sibling.read_text() == "my other notes\n"
    assert decode.main(["--model_name_or_path", str(run), "--output_file", str(mine), "--overwrite_output", *DECODE]) == 0
    assert len(mine.read_text().splitlines()) == len(TEST_PAIRS)
    # the default generations.<split>.txt in the model directory is decode's own: a new decoding replaces it
    for _ in range(2):
        assert decode.main(["--model_name_or_path", str(run), *DECODE]) == 0
    assert len((run / "generations.test.txt").read_text().splitlines()) == len(TEST_PAIRS)


def test_decode_refuses_an_output_file_that_is_a_directory_or_a_jsonl(run_elsewhere, tmp_path, capsys, no_decoding):
    run, _, _ = run_elsewhere
    (tmp_path / "folder").mkdir()
    assert decode.main(["--model_name_or_path", str(run), "--output_file", str(tmp_path / "folder"), *DECODE]) == 1
    assert "is a directory" in one_error_line(capsys)
    assert decode.main(["--model_name_or_path", str(run), "--output_file", str(tmp_path / "out.jsonl"), *DECODE]) == 1
    assert ".jsonl" in one_error_line(capsys)


def test_decode_refuses_an_unwritable_output_location_before_decoding(run_elsewhere, tmp_path, capsys, no_decoding,
                                                                     monkeypatch):
    run, _, _ = run_elsewhere
    (tmp_path / "plain").write_text("a file, not a folder\n")
    assert decode.main(["--model_name_or_path", str(run), "--output_file", str(tmp_path / "plain" / "h.txt"),
                        *DECODE]) == 1
    assert "cannot be written" in one_error_line(capsys)

    import errno
    import tempfile

    real = tempfile.TemporaryFile

    def read_only(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).resolve() == run.resolve():
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)  # a read-only mount (root ignores chmod)
    assert decode.main(["--model_name_or_path", str(run), *DECODE]) == 1
    error = one_error_line(capsys)
    assert str(run) in error and "Read-only file system" in error
    assert decode.main(["--model_name_or_path", str(run), "--output_file", str(tmp_path / "h.txt"), *DECODE]) == 1
    assert "eval_results.json" in one_error_line(capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_decode_refuses_a_read_only_model_dir_before_decoding(run_elsewhere, capsys, no_decoding):
    run, _, _ = run_elsewhere
    run.chmod(0o555)
    try:
        assert decode.main(["--model_name_or_path", str(run), *DECODE]) == 1
        assert str(run) in one_error_line(capsys)
    finally:
        run.chmod(0o755)


# ------------------------------------------------------------------------------ 4. method tools, another type
TOOLS = {
    "flexformers-iot-orders": (iot_order_analysis.main, lambda d: ["--model_name_or_path", d], "IOT"),
    "flexformers-indigo-trace": (indigo_trace.main, lambda d: ["--model_dir", d, "--source", "open the file"], "InDIGO"),
    "flexformers-depth-adaptive": (depth_adaptive_tools.main, lambda d: ["evaluate", "--model_name_or_path", d],
                                   "Depth-Adaptive"),
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_a_method_tool_refuses_another_types_model_in_one_line(model_dir, capsys, tool):  # noqa: F811
    main, argv, method = TOOLS[tool]
    assert main(argv(str(model_dir))) == 1
    error = one_error_line(capsys, tool)
    assert f"{tool} needs a" in error and method in error and f"{model_dir} holds a 'flexformer' model" in error


def test_a_method_tool_exits_0_on_success(monkeypatch):
    # the console script exits with main()'s value: a report dict there would read as failure (and be printed)
    monkeypatch.setattr(depth_adaptive_tools, "command_evaluate", lambda args: {"bleu": 1.0})
    assert depth_adaptive_tools.main(["evaluate", "--model_name_or_path", "runs/x"]) == 0
    assert depth_adaptive_tools.run_from_argv(["evaluate", "--model_name_or_path", "runs/x"]) == {"bleu": 1.0}


# ------------------------------------------------------------------------------ 5. data-file edge cases
def test_a_data_file_that_is_not_a_regular_file_is_named(tmp_path):
    (tmp_path / "data.tsv").mkdir()
    with pytest.raises(ValueError, match=r"data.tsv: is a directory, not a data file"):
        read_parallel_file(tmp_path / "data.tsv")
    os.mkfifo(tmp_path / "pipe.tsv")
    with pytest.raises(ValueError, match=r"pipe.tsv: not a regular file"):
        read_parallel_file(tmp_path / "pipe.tsv")
    with pytest.raises(ValueError, match=r"missing.tsv: file not found"):
        read_parallel_file(tmp_path / "missing.tsv")


def test_an_unreadable_data_file_is_named(tmp_path, monkeypatch):
    path = write_pairs(tmp_path / "data.tsv", TEST_PAIRS)

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)  # chmod 000 does not stop root
    with pytest.raises(ValueError, match=r"data.tsv: cannot be read \(Permission denied\)"):
        read_parallel_file(path)


def test_one_column_for_both_sides_or_a_repeated_header_name_is_refused(tmp_path):
    path = write_pairs(tmp_path / "data.tsv", TEST_PAIRS)
    with pytest.raises(ValueError, match=r"--source_column and --target_column are both 'source'"):
        read_parallel_file(path, source_column="source", target_column="source")
    (tmp_path / "twice.tsv").write_text("source\tsource\ttarget\na\tb\tc\n")
    with pytest.raises(ValueError, match=r"twice.tsv, line 1: the header names column 'source' twice"):
        read_parallel_file(tmp_path / "twice.tsv")


def test_a_bom_crlf_test_file_with_other_columns_reads_like_the_training_file(tmp_path):
    (tmp_path / "test.tsv").write_bytes("\ufeffid\ttarget\tsource\r\n1\tb c\ta d\r\n".encode())
    rows = read_parallel_file(tmp_path / "test.tsv")
    assert [(row["source"], row["target"]) for row in rows] == [("a d", "b c")]


# ------------------------------------------------------------------------------ 6. generate(decoder_start_token_id)
@pytest.mark.parametrize("value", [10**6, 60, -1])
def test_generate_names_an_out_of_vocabulary_decoder_start_token_id(value):
    for model in _tiny_models():
        with pytest.raises(ValueError, match=rf"generate\(\): decoder_start_token_id {value} is outside the target "
                                             r"vocabulary \[0, 60\)"):
            model.generate(torch.tensor([[5, 6, 2]]), decoder_start_token_id=value, max_new_tokens=2)


def test_generate_checks_the_decoder_start_of_its_generation_config_and_the_target_vocabulary():
    from flexformers.configuration import FlexformerConfig
    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration

    from .conftest import tiny_config_kwargs

    for model in _tiny_models():
        model.generation_config.decoder_start_token_id = 77
        with pytest.raises(ValueError, match=r"decoder_start_token_id 77 is outside the target vocabulary \[0, 60\)"):
            model.generate(torch.tensor([[5, 6, 2]]), max_new_tokens=2)
    separate = FlexformerForConditionalGeneration(FlexformerConfig(**tiny_config_kwargs(
        target_vocab_size=40, share_all_embeddings=False))).eval()
    with pytest.raises(ValueError, match=r"decoder_start_token_id 50 is outside the target vocabulary \[0, 40\)"):
        separate.generate(torch.tensor([[5, 55, 2]]), decoder_start_token_id=50, max_new_tokens=2)
    assert separate.generate(torch.tensor([[5, 55, 2]]), decoder_start_token_id=39, max_new_tokens=2)[0, 0] == 39


def test_indigo_refuses_a_decoder_start_token_id_it_would_not_use():
    indigo = next(model for model in _tiny_models() if model.config.model_type == "indigo")
    with pytest.raises(ValueError, match=r"InDIGO generate\(\): decoder_start_token_id=5 .*<s> </s>"):
        indigo.generate(torch.tensor([[5, 6, 2]]), decoder_start_token_id=5, max_new_tokens=2)
    start = indigo.config.bos_token_id  # what insertion decoding starts from anyway
    assert indigo.generate(torch.tensor([[5, 6, 2]]), decoder_start_token_id=start, max_new_tokens=2)[0, 0] == start


# ------------------------------------------------------------------ 7. decode's options reach the decoding (issue 65)
# sources and references of different lengths: pair 0's source is too long (4 > 3 words), pair 1's reference is too
# long (4 > 3 words), pair 2 fits both
LENGTH_PAIRS = [("a b c d", "w x"), ("e f", "w x y z"), ("g h i", "y z")]


def lookup_decode(tmp_path, monkeypatch, *options):
    """decode.run_from_argv on ``LENGTH_PAIRS`` with the model replaced by a lookup table: (results, the sources
    generate_texts was given, its keyword arguments). With ``permutation_of_source`` the stand-in returns each
    source's words reversed (a permutation of them), else ``out <source>``."""
    (tmp_path / "train.tsv").write_text("source\ttarget\na b\tc d\n", encoding="utf-8")
    write_pairs(tmp_path / "test.tsv", LENGTH_PAIRS)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="flexformer"))
    monkeypatch.setattr(decode, "load_model", lambda *args, **kwargs: (model, WordTokenizer(),
                                                                       WordTokenizer()))
    calls = []

    def generate_texts(model, source_tokenizer, target_tokenizer, sources, **kwargs):
        calls.append((list(sources), kwargs))
        permuted = kwargs.get("permutation_of_source", False)
        hypotheses = [" ".join(reversed(s.split())) if permuted else f"out {s}" for s in sources]
        return hypotheses, {"sentences": len(sources), "seconds": 1.0, "sentences_per_second": 3.0,
                            "tokens_per_second": 9.0}

    monkeypatch.setattr(decode, "generate_texts", generate_texts)
    results = decode.run_from_argv([
        "--model_name_or_path", str(model_dir), "--task", "files", "--train_file", str(tmp_path / "train.tsv"),
        "--test_file", str(tmp_path / "test.tsv"), "--split", "test", "--max_source_length", "3",
        "--max_target_length", "3", *options])
    (sources, kwargs), = calls
    return results, sources, kwargs


def test_decode_permutation_of_source_constrains_the_decoding_and_is_reported(tmp_path, monkeypatch, capsys):
    results, sources, kwargs = lookup_decode(tmp_path, monkeypatch, "--permutation_of_source", "true",
                                             "--num_samples_to_print", "0")
    assert kwargs["permutation_of_source"] is True
    written = (tmp_path / "model" / "generations.test.txt").read_text().splitlines()
    assert written == ["d c b a", "f e", "i h g"]  # each output a permutation of its source's words
    assert results["output_constraint"] == "permutation of the source words"
    assert "examples, outputs constrained to a permutation of the source words, beam" in capsys.readouterr().out
    # and off by default for a task that is not word-order recovery: the outputs are not constrained
    (tmp_path / "plain").mkdir()
    results, _, kwargs = lookup_decode(tmp_path / "plain", monkeypatch, "--num_samples_to_print", "0")
    assert kwargs["permutation_of_source"] is False and results["output_constraint"] is None


def test_decode_within_training_lengths_drops_pairs_too_long_on_either_side(tmp_path, monkeypatch, capsys):
    results, sources, _ = lookup_decode(tmp_path, monkeypatch, "--within_training_lengths", "true",
                                        "--num_samples_to_print", "0")
    assert sources == ["g h i"]  # pair 0's source and pair 1's reference are beyond 3 tokens
    rows = [json.loads(line) for line in (tmp_path / "model" / "generations.test.jsonl").read_text().splitlines()]
    assert [(row["index"], row["reference"]) for row in rows] == [(2, "y z")]
    assert results["num_examples"] == 1 and results["within_training_lengths"] is True
    printed = capsys.readouterr().out
    assert re.search(r"\[test, 1 examples within the training lengths, beam 5, lenpen 1.0\]: BLEU", printed)


def test_decode_prints_each_sample_with_its_source_reference_and_output(tmp_path, monkeypatch, capsys):
    lookup_decode(tmp_path, monkeypatch, "--num_samples_to_print", "2")
    printed = capsys.readouterr().out
    assert ("--- sample 1 " + "-" * 60 + "\nSOURCE:     a b c d\nREFERENCE:\nw x\nGENERATED:\nout a b c d\n"
            "--- sample 2 " + "-" * 60 + "\nSOURCE:     e f\nREFERENCE:\nw x y z\nGENERATED:\nout e f\n"
            + "-" * 72 + "\n") in printed
    assert "sample 3" not in printed
    assert re.search(r"\[test, 3 examples, beam 5, lenpen 1.0\]: BLEU ", printed)


def test_read_stdin_lines_skips_blank_lines_and_names_lines_that_are_not_utf8(caplog):
    raw = b"one\n\xff\xfe\n\n  \ntwo \xc3\xa9\r\nthree\n"  # line 2 is not UTF-8; lines 3 and 4 are blank
    with caplog.at_level(logging.WARNING):
        assert decode.read_stdin_lines(types.SimpleNamespace(buffer=io.BytesIO(raw))) == (
            ["one", "two \u00e9", "three"], [2])
    assert "standard input, line 2: not valid UTF-8 (byte 0); skipped" in caplog.text
    # a text stream (no .buffer) is taken as already decoded
    assert decode.read_stdin_lines(io.StringIO("a\n\nb c\n")) == (["a", "b c"], [])


# Round 2 mutation survivors (issue 65)
FC1_BIAS = "model.encoder.layers.0.ffn.fc1.bias"


def without_weight(directory: Path, name: str = FC1_BIAS) -> Path:
    """``directory`` with one tensor taken out of its ``model.safetensors`` (a checkpoint of another architecture)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def read_only_folder(monkeypatch, folder: Path):
    """Creating a file in ``folder`` fails as on a read-only mount (root ignores chmod)."""
    import errno
    import tempfile

    real = tempfile.TemporaryFile

    def read_only(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).resolve() == folder.resolve():
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)


def test_an_unwritable_output_location_says_which_option_avoids_it(run_elsewhere, tmp_path, capsys, no_decoding,
                                                                   monkeypatch):
    run, _, _ = run_elsewhere
    (tmp_path / "plain").write_text("a file, not a folder\n")
    assert decode.main(["--model_name_or_path", str(run), "--output_file", str(tmp_path / "plain" / "h.txt"),
                        *DECODE]) == 1
    assert one_error_line(capsys).endswith(
        f"{tmp_path / 'plain'} cannot be written ({tmp_path / 'plain'} is not a directory): decoding writes the "
        "hypotheses there; choose another --output_file")
    read_only_folder(monkeypatch, run)
    assert decode.main(["--model_name_or_path", str(run), "--output_file", str(tmp_path / "h.txt"), *DECODE]) == 1
    assert one_error_line(capsys).endswith(
        f"{run} cannot be written (Read-only file system): decoding writes eval_results.json there; "
        "pass --write_eval_results false")
    with pytest.raises(AssertionError, match="decoded before refusing"):  # the option named gets past the checks
        decode.main(["--model_name_or_path", str(run), "--output_file", str(tmp_path / "h.txt"),
                     "--write_eval_results", "false", *DECODE])


def test_a_read_only_model_dir_names_both_options_it_takes_to_decode(run_elsewhere, capsys, no_decoding, monkeypatch):
    run, _, _ = run_elsewhere
    read_only_folder(monkeypatch, run)
    assert decode.main(["--model_name_or_path", str(run), *DECODE]) == 1
    error = one_error_line(capsys)
    assert "the hypotheses and eval_results.json" in error
    assert "choose another --output_file" in error and "pass --write_eval_results false" in error


def test_decode_refuses_a_checkpoint_missing_a_weight_naming_the_option_that_allows_it(
        model_dir, tmp_path, capsys):  # noqa: F811
    broken = without_weight(Path(shutil.copytree(model_dir, tmp_path / "model")))
    argv = ["--model_name_or_path", str(broken), "--text", "open the file", "--num_beams", "1", "--max_new_tokens", "2"]
    assert decode.main(argv) == 1
    error = one_error_line(capsys)
    assert FC1_BIAS in error and error.endswith("(pass --allow_missing_weights to decode with them anyway)")
    assert decode.main([*argv, "--allow_missing_weights"]) == 0
    assert "OUTPUT:" in capsys.readouterr().out


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_a_method_tool_refusing_a_missing_weight_names_no_option_it_lacks(tmp_path, capsys, tool):
    from flexformers.configuration import DepthAdaptiveConfig, InDIGOConfig, IOTConfig
    from flexformers.modeling.modeling_depth_adaptive import DepthAdaptiveForConditionalGeneration
    from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration
    from flexformers.modeling.modeling_iot import IOTForConditionalGeneration

    from .conftest import tiny_config_kwargs

    config_class, model_class = {
        "flexformers-iot-orders": (IOTConfig, IOTForConditionalGeneration),
        "flexformers-indigo-trace": (InDIGOConfig, InDIGOForConditionalGeneration),
        "flexformers-depth-adaptive": (DepthAdaptiveConfig, DepthAdaptiveForConditionalGeneration)}[tool]
    model_class(config_class(**tiny_config_kwargs())).save_pretrained(tmp_path / "model")
    without_weight(tmp_path / "model")
    main, argv, _ = TOOLS[tool]
    assert main(argv(str(tmp_path / "model"))) == 1
    error = one_error_line(capsys, tool)
    assert FC1_BIAS in error  # the refusal itself is right; its hint is decode's
    assert "--allow_missing_weights" not in error


def test_models_load_in_float32_for_evaluation_unless_bf16_is_asked(model_dir):  # noqa: F811
    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration

    for load in (lambda **kw: decode.load_model(model_dir, **kw),
                 lambda **kw: decode.load_method_model(model_dir, FlexformerForConditionalGeneration,
                                                       "flexformers-x", "a plain", **kw)):
        model, source_tokenizer, target_tokenizer = load()
        assert {p.dtype for p in model.parameters()} == {torch.float32} and not model.training
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        assert source_tokenizer("open the file")["input_ids"] == target_tokenizer("open the file")["input_ids"]
        model, _, _ = load(bf16=True)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not model.training


def test_text_mode_prints_each_input_with_its_output_reports_throughput_and_writes_nothing(
        model_dir, capsys):  # noqa: F811
    before = sorted(p.name for p in model_dir.iterdir())
    results = decode.run_from_argv(["--model_name_or_path", str(model_dir), "--text", "open the file", "read line 7",
                                    "--num_beams", "1", "--max_new_tokens", "3"])
    hypotheses = results["hypotheses"]
    assert len(hypotheses) == 2 and results["skipped_lines"] == []
    assert (f"SOURCE: open the file\nOUTPUT: {hypotheses[0]}\n\nSOURCE: read line 7\nOUTPUT: {hypotheses[1]}\n"
            in capsys.readouterr().out)
    throughput = results["throughput"]
    assert throughput["sentences"] == 2 and 0 <= throughput["generated_tokens"] <= 2 * 3
    assert {"seconds", "sentences_per_second", "tokens_per_second"} <= set(throughput)
    assert sorted(p.name for p in model_dir.iterdir()) == before  # a quick look leaves no files behind


def test_decode_writes_non_ascii_text_as_itself_in_every_file(tmp_path, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "Übungen.tsv").write_text("source\ttarget\na b\tc d\n", encoding="utf-8")
    write_pairs(folder / "test.tsv", [("grüße die Straße", "greet the street"), ("naïve café", "naive coffee")])
    run_dir = tmp_path / "model"
    run_dir.mkdir()
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="flexformer"))
    monkeypatch.setattr(decode, "load_model", lambda *args, **kwargs: (model, WordTokenizer(), WordTokenizer()))
    monkeypatch.setattr(decode, "generate_texts", lambda model, s, t, sources, **kwargs: (
        [f"→ {source}" for source in sources], {"sentences": len(sources), "seconds": 1.0,
                                                "sentences_per_second": 2.0, "tokens_per_second": 4.0}))
    decode.run_from_argv(["--model_name_or_path", str(run_dir), "--task", "files",
                          "--train_file", str(folder / "Übungen.tsv"), "--test_file", str(folder / "test.tsv"),
                          "--num_samples_to_print", "0"])
    assert (run_dir / "generations.test.txt").read_text(encoding="utf-8") == "→ grüße die Straße\n→ naïve café\n"
    jsonl = (run_dir / "generations.test.jsonl").read_text(encoding="utf-8")
    assert '"source": "grüße die Straße"' in jsonl and '"hypothesis": "→ naïve café"' in jsonl and "\\u" not in jsonl
    report = (run_dir / "eval_results.json").read_text(encoding="utf-8")
    assert '"dataset": "Übungen.tsv' in report and "\\u" not in report


def test_rescoring_a_code_task_within_the_training_lengths_reports_pov(tmp_path, monkeypatch):
    import ast

    def parses(text):
        try:
            ast.parse(text)
        except SyntaxError:
            return False
        return True

    run_dir = tmp_path / "model"
    run_dir.mkdir()
    DataArguments(task="codegen", python_source_dirs=[str(tmp_path)], max_source_length=5,
                  max_target_length=7).save(run_dir)
    monkeypatch.setattr(decode, "load_tokenizers", lambda directory: (WordTokenizer(), WordTokenizer()))
    rows = [  # (source, reference, hypothesis); pair 1's source has 6 words, beyond the 5 of training
        ("Add two numbers.", "def add(a, b):\n    return a + b", "def add(a, b):\n    return a + b"),
        ("Return the given number doubled, please.", "def double(x):\n    return 2 * x", "def double(x):\n    return"),
        ("Negate a number.", "def neg(x):\n    return -x", "def neg(x:\n    return -x"),
        ("Return one.", "def one():\n    return 1", "def one():\n    return 1"),
    ]
    generations = tmp_path / "g.jsonl"
    generations.write_text("".join(json.dumps({"index": i, "origin": "m.py", "source": s, "reference": r,
                                               "hypothesis": h}) + "\n" for i, (s, r, h) in enumerate(rows)))
    scores = decode.score_within_training_lengths(generations, run_dir)
    kept = [rows[0], rows[2], rows[3]]
    assert scores["num_examples"] == 3
    assert scores["metrics"]["pov"] == round(100 * sum(parses(h) for _, _, h in kept) / 3, 2) == 66.67
    assert scores["copy_baseline"]["pov"] == 0.0  # a docstring is no Python
    assert scores["gain_over_copy"]["pov"] == 66.67


# ---- issue 65, round 3: the held-out sample's (seed 2) survivors ----


def test_a_run_whose_files_have_saved_hashes_is_not_said_to_hold_relative_paths(run_elsewhere, caplog):
    """The relative-paths warning is for runs saved before paths were stored absolute (no hashes); a current run
    given a relative `--test_file` on the command line is not warned about its saved paths."""
    run, _, _ = run_elsewhere
    with caplog.at_level(logging.WARNING):
        decode.run_from_argv(["--model_name_or_path", str(run), "--test_file", "test.tsv", *DECODE])
    assert not [r for r in caplog.records if "relative paths" in r.getMessage()]


def test_the_printed_report_names_every_metric_as_its_papers_do(capsys):
    """BLEU, chrF, TER and the share of outputs that parse (PoV) are printed under their usual names, in the scores,
    the copy baseline and the gains alike."""
    scores = {"bleu": 6.58, "chrf": 17.36, "ter": 94.89, "pov": 74.43}
    results = {"metrics": scores, "dataset": "codegen", "split": "test", "num_examples": 1, "num_beams": 4,
               "length_penalty": 1.0, "copy_baseline": {**scores, "pov": 0.84},
               "gain_over_copy": {"bleu": 5.83, "chrf": 3.83, "ter": 1.0, "pov": 73.59},
               "sacrebleu_signature": "nrefs:1", "throughput": {"sentences_per_second": 1, "tokens_per_second": 2,
                                                               "dtype": "float32", "device": "cpu", "batch_size": 1}}
    decode.print_report(results, ["a docstring"], ["def f(): pass"], ["def f(): pass"], 0, "out.jsonl")
    printed = capsys.readouterr().out
    assert "BLEU 6.58  chrF 17.36  TER 94.89  PoV 74.43" in printed
    assert "PoV 0.84" in printed and "PoV +73.59" in printed
    assert "pov" not in printed
