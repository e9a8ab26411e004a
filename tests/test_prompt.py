import pytest
from tokenizers import Tokenizer

from predictor.model import default_backbone_path
from predictor.prompt import InputFormat, encode_turns, messages_to_turns
from training.export import input_format_for

pytestmark = pytest.mark.unit


def _tok():
    t = Tokenizer.from_file(str(default_backbone_path() / "tokenizer.json"))
    t.no_truncation()
    t.no_padding()
    return t


def test_input_format_reads_bert_special_tokens():
    fmt = input_format_for(_tok(), 64, None)
    assert fmt.prefix_ids == (101,) and fmt.suffix_ids == (102,) and fmt.pad_id == 0


def test_latest_turn_kept_and_budget_respected():
    tok = _tok()
    fmt = InputFormat(32, (101,), (102,), 0)
    old = ("user", "ancient history " * 50)
    latest = ("user", "how long is the answer")
    (enc,) = encode_turns(tok, fmt, [[old, ("assistant", "reply " * 40), latest]])
    assert len(enc.ids) == 32 and enc.truncated
    text = tok.decode(enc.ids)
    assert text.endswith("user : how long is the answer")


def test_long_latest_turn_keeps_head_and_tail():
    tok = _tok()
    fmt = InputFormat(40, (101,), (102,), 0)
    body = "start " + "filler " * 300 + "finish"
    (enc,) = encode_turns(tok, fmt, [[("user", body)]])
    text = tok.decode(enc.ids)
    assert len(enc.ids) == 40 and enc.truncated and "start" in text and "finish" in text


def test_short_prompt_untouched_and_messages():
    tok = _tok()
    fmt = InputFormat(64, (101,), (102,), 0)
    turns = messages_to_turns([{"role": "system", "content": "be brief"},
                               {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    (enc,) = encode_turns(tok, fmt, [turns])
    assert not enc.truncated and tok.decode(enc.ids) == "system : be brief user : hi"


def test_length_hints_survive_truncation():
    tok = _tok()
    fmt = InputFormat(48, (101,), (102,), 0, length_hints=True)
    convo = [("user", "write code " * 20), ("assistant", "here is code " * 300), ("user", "now make it shorter")]
    (enc,) = encode_turns(tok, fmt, [convo])
    text = tok.decode(enc.ids)
    assert len(enc.ids) == 48 and enc.truncated
    assert text.startswith("assistant ( ~ 900 words ) :")
    assert text.endswith("user ( ~ 4 words ) : now make it shorter")
    assert InputFormat.from_dict(fmt.to_dict()) == fmt
