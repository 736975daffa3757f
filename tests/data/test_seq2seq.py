"""JSON-lines seq2seq tasks: reading, line-numbered errors, tokenization with EOS."""

import json

import numpy as np
import pytest

from qmoe_jax.data import read_jsonl, tokenize_examples
from qmoe_jax.data.tokenizer import EOS_ID


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_reads_pairs_in_order_and_skips_blank_lines(tmp_path):
    path = write_lines(
        tmp_path / "task.jsonl",
        [
            json.dumps({"inputs": "a b", "targets": "c"}),
            "",
            json.dumps({"inputs": "d", "targets": "e f", "id": 3}),
        ],
    )
    examples = read_jsonl(path)
    assert [(e.inputs, e.targets) for e in examples] == [("a b", "c"), ("d", "e f")]
    assert examples[1].source == f"{path}:3"


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ('["inputs", "targets"]', "expected a JSON object"),
        ('{"inputs": "x"}', '"targets" must be a string, it is missing'),
        ('{"inputs": 3, "targets": "y"}', '"inputs" must be a string, it is a int'),
    ],
)
def test_malformed_line_is_named(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps({"inputs": "a", "targets": "b"}), line])
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{message}"):
        read_jsonl(path)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="holds no examples"):
        read_jsonl(write_lines(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(ValueError, match="cannot read task file"):
        read_jsonl(str(tmp_path / "absent.jsonl"))


def test_sentinels_in_targets_are_sentinel_ids(tmp_path, tiny_tokenizer):
    path = write_lines(
        tmp_path / "task.jsonl",
        [
            json.dumps(
                {"inputs": "the <extra_id_0> runs", "targets": "<extra_id_0> model <extra_id_1>"}
            )
        ],
    )
    ((_, targets),) = tokenize_examples(read_jsonl(path), tiny_tokenizer)
    expected = [
        tiny_tokenizer.sentinel(0),
        *tiny_tokenizer.encode("model"),
        tiny_tokenizer.sentinel(1),
        EOS_ID,
    ]
    assert targets.tolist() == expected


def test_tokenize_appends_eos_and_truncates(tmp_path, tiny_tokenizer):
    path = write_lines(
        tmp_path / "task.jsonl",
        [
            json.dumps(
                {
                    "inputs": "the model <extra_id_0> runs",
                    "targets": "the sparse dense switch layer",
                }
            )
        ],
    )
    ((inputs, targets),) = tokenize_examples(read_jsonl(path), tiny_tokenizer)
    assert inputs[-1] == EOS_ID and targets[-1] == EOS_ID
    assert tiny_tokenizer.sentinel(0) in inputs
    np.testing.assert_array_equal(
        targets[:-1], tiny_tokenizer.encode("the sparse dense switch layer")
    )
    ((short_inputs, short_targets),) = tokenize_examples(read_jsonl(path), tiny_tokenizer, 3, 2)
    assert short_inputs.tolist() == inputs[:2].tolist() + [EOS_ID]
    assert short_targets.tolist() == [targets[0], EOS_ID]
