"""Pipeline tokenizers: byte-level BPE with the flexformers special ids, lossless round trips, save/load."""

import pytest

from flexformers.training_scripts.tokenizer import (
    SOURCE_TOKENIZER_SUBDIR,
    SPECIAL_TOKENS,
    build_tokenizers,
    check_special_ids,
    load_tokenizers,
    save_tokenizers,
    train_bpe_tokenizer,
)

CODE = [
    "def add(a, b):\n    return a + b",
    "class Stack:\n\n    def push(self, item):\n        self.items.append(item)\n\tpass",
    "async def fetch(url):\n    async with session.get(url) as r:\n        return await r.text()",
]
GERMAN = ["Datei öffnen", "Größe ändern …", "Schließen", "Über dieses Programm"]
ENGLISH = ["Open file", "Resize", "Close", "About this program"]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(CODE * 5 + GERMAN * 5 + ENGLISH * 5, vocab_size=400)


def test_special_token_ids(tokenizer):
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2, 3)
    assert "<eod>" in tokenizer.all_special_tokens


@pytest.mark.parametrize("text", CODE + GERMAN + ["emoji 🙂 and ∑ unseen", "  leading and trailing  ", "x\r\ny"])
def test_round_trip_is_lossless_and_ends_with_eos(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert ids[-1] == 2 and 0 not in ids and 3 not in ids  # byte level: nothing is unknown
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_batch_padding_uses_pad_id_1(tokenizer):
    batch = tokenizer(["a", "a much longer text"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, -1].item() == 1 and batch["attention_mask"][0, -1].item() == 0


def test_joint_and_separate_save_load(tmp_path):
    joint_src, joint_tgt = build_tokenizers(ENGLISH * 3, GERMAN * 3, joint=True, vocab_size=300)
    assert joint_src is joint_tgt
    save_tokenizers(tmp_path / "joint", joint_src, joint_tgt)
    src, tgt = load_tokenizers(tmp_path / "joint")
    assert src is tgt and src("Open file")["input_ids"] == joint_src("Open file")["input_ids"]

    sep_src, sep_tgt = build_tokenizers(ENGLISH * 3, GERMAN * 3, joint=False, vocab_size=290, target_vocab_size=300)
    assert sep_src is not sep_tgt
    save_tokenizers(tmp_path / "sep", sep_src, sep_tgt)
    assert (tmp_path / "sep" / SOURCE_TOKENIZER_SUBDIR / "tokenizer.json").is_file()
    src, tgt = load_tokenizers(tmp_path / "sep")
    assert src is not tgt
    assert tgt.decode(tgt("Schließen")["input_ids"], skip_special_tokens=True) == "Schließen"
    assert src.get_vocab() == sep_src.get_vocab() and tgt.get_vocab() == sep_tgt.get_vocab()


def test_errors(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="vocab_size must be at least"):
        train_bpe_tokenizer(["a"], vocab_size=100)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizers(tmp_path)

    class Wrong:
        def convert_tokens_to_ids(self, token):
            return 7

    with pytest.raises(ValueError, match="flexformers needs 0"):
        check_special_ids(Wrong())
