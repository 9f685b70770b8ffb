import json
import re
from pathlib import Path

import pytest

from trainer.config import DataConfig, SyntheticData
from trainer.data import DataError, prepare, synthetic


def _check_arithmetic(answer: str) -> int:
    lines = answer.splitlines()
    value = None
    for line in lines[:-1]:
        m = re.fullmatch(r"(\d+)([+\-*])(\d+)=(-?\d+)", line)
        assert m, line
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        assert value is None or a == value
        assert c == {"+": a + b, "-": a - b, "*": a * b}[op]
        value = c
    assert lines[-1] == f"#### {value}"
    return value


def test_synthetic_is_deterministic_correct_and_disjoint():
    cfg = SyntheticData(n_train=400, n_test=100, min_ops=1, max_ops=3)
    a, b = synthetic(cfg, seed=1), synthetic(cfg, seed=1)
    assert a.train == b.train and a.test == b.test
    assert synthetic(cfg, seed=2).train != a.train
    test_q = {ex["messages"][0]["content"] for ex in a.test}
    assert not test_q & {ex["messages"][0]["content"] for ex in a.train}
    for ex in a.train + a.test:
        assert str(_check_arithmetic(ex["messages"][-1]["content"])) == ex["answer"]
        assert int(ex["answer"]) >= 0
        n_steps = len(ex["messages"][-1]["content"].splitlines()) - 1
        assert 1 <= n_steps <= 3


def test_synthetic_knobs():
    data = synthetic(SyntheticData(n_train=50, n_test=10, min_ops=2, max_ops=2, digits=2, ops=["+"]), seed=0)
    for ex in data.train:
        steps = ex["messages"][-1]["content"].splitlines()[:-1]
        assert len(steps) == 2 and all("+" in s for s in steps)
        assert all(10 <= int(n) <= 99 for n in re.findall(r"\d+", steps[0].split("=")[0]))


def test_worked_fraction_mixes_answer_only_rows_into_train_only():
    full = synthetic(SyntheticData(n_train=2000, n_test=100), seed=3)
    mixed = synthetic(SyntheticData(n_train=2000, n_test=100, worked_fraction=0.5), seed=3)
    # the answer style has its own random stream: the same questions, the same held-out split
    assert [ex["messages"][0] for ex in mixed.train] == [ex["messages"][0] for ex in full.train]
    assert mixed.test == full.test
    terse = 0
    for a, b in zip(full.train, mixed.train):
        answer = b["messages"][-1]["content"]
        if answer != a["messages"][-1]["content"]:
            assert answer == f"#### {a['answer']}" and b["answer"] == a["answer"]
            terse += 1
    assert 900 <= terse <= 1100
    none = synthetic(SyntheticData(n_train=200, n_test=10, worked_fraction=0.0), seed=3)
    assert all(ex["messages"][-1]["content"] == f"#### {ex['answer']}" for ex in none.train)
    assert all("=" in ex["messages"][-1]["content"] for ex in none.test)


@pytest.mark.slow
def test_synthetic_too_few_distinct_problems():
    with pytest.raises(DataError, match=r"only \d+ distinct held-out problems \(of n_test=100000\).*raise digits"):
        synthetic(SyntheticData(n_train=10, n_test=100_000, max_ops=1, ops=["+"]), seed=0)


# The equation a question computes, read from its words (not from the generator's own record):
# "Ann has 5 apples. Ann buys 3 more. The pile grows 2 times bigger. ..." -> (5, ("+", 3), ("*", 2))
_OP_WORDS = [(re.compile(r"(?:buys|finds|gets) (\d+) more\."), "+"),
             (re.compile(r"(?:gives away|loses|sells) (\d+)\."), "-"),
             (re.compile(r"(\d+) times"), "*")]


def _equation(question: str) -> tuple:
    first, *rest = question.split(". ")
    equation: list = [int(re.search(r"has (\d+) ", first)[1])]
    for sentence in rest:
        if sentence.startswith("How many"):
            break
        ops = [(op, int(m[1])) for pattern, op in _OP_WORDS if (m := pattern.search(sentence + "."))]
        assert len(ops) == 1, sentence
        equation.append(ops[0])
    return tuple(equation)


def _mix(examples: list[dict]) -> dict[str, float]:
    eqs = [_equation(ex["messages"][0]["content"]) for ex in examples]
    out = {f"{k} steps": sum(len(e) - 1 == k for e in eqs) / len(eqs) for k in (1, 2)}
    n_ops = sum(len(e) - 1 for e in eqs)
    out.update({f"op {op}": sum(o == op for e in eqs for o, _ in e[1:]) / n_ops for op in "+-*"})
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_held_out_equations_never_appear_in_training(seed):
    """The embedded default's split: no held-out equation (start value, every operation and
    operand) is trained on, whatever the names and wording, and both sides keep the same mix of
    steps and operations."""
    from trainer.config import load_config

    cfg = load_config("tiny").data.synthetic
    data = synthetic(cfg, seed)
    assert (len(data.train), len(data.test)) == (cfg.n_train, cfg.n_test)
    for ex in data.train[:2000] + data.test:  # the words and the worked answer agree on the equation
        worked = ex["messages"][-1]["content"]
        if "=" in worked:
            steps = [re.fullmatch(r"\d+([+\-*])(\d+)=\d+", line).groups() for line in worked.splitlines()[:-1]]
            assert [(op, int(n)) for op, n in steps] == list(_equation(ex["messages"][0]["content"])[1:])
    train_eqs = {_equation(ex["messages"][0]["content"]) for ex in data.train}
    test_eqs = {_equation(ex["messages"][0]["content"]) for ex in data.test}
    assert not train_eqs & test_eqs
    assert len({ex["messages"][0]["content"] for ex in data.test}) == cfg.n_test  # distinct questions
    # not a handful of equations reworded: about a fifth of the 4,936 equations are held out, and
    # 1,000 rows drawn with the generator's frequencies cover a good part of them
    assert len(test_eqs) > 300 and len(train_eqs) > 3000
    train_mix, test_mix = _mix(data.train), _mix(data.test)
    for k in train_mix:  # 1,000 test rows: a binomial share's sd is at most 1.6 points
        assert abs(train_mix[k] - test_mix[k]) < 0.06, (k, train_mix, test_mix)


def test_held_out_split_other_settings():
    cfg = SyntheticData(n_train=3000, n_test=300, min_ops=1, max_ops=3, digits=2, held_out_fraction=0.3)
    data = synthetic(cfg, 5)
    train_eqs = {_equation(ex["messages"][0]["content"]) for ex in data.train}
    assert not train_eqs & {_equation(ex["messages"][0]["content"]) for ex in data.test}


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_local_jsonl_with_field_mapping_and_split(tmp_path):
    rows = [{"q": f"What is {i}+1?", "a": f"{i}+1={i+1}\n#### {i+1}"} for i in range(30)]
    cfg = DataConfig(source="files", train=_write(tmp_path / "t.jsonl", rows),
                     fields={"question": "q", "answer": "a"}, test_size=5)
    data = prepare(cfg, seed=0)
    assert len(data.train) == 25 and len(data.test) == 5
    assert prepare(cfg, seed=0).test == data.test  # deterministic split
    ex = data.test[0]
    assert ex["messages"][0]["role"] == "user" and ex["answer"] == ex["messages"][1]["content"].split("#### ")[1]


def test_gsm8k_commas_and_messages_format(tmp_path):
    train = _write(tmp_path / "train.jsonl", [{"question": "q", "answer": "big\n#### 1,200"}] * 3)
    test = _write(tmp_path / "test.jsonl", [{"messages": [{"role": "user", "content": "q"},
                                                          {"role": "assistant", "content": "\\boxed{7}"}]}])
    data = prepare(DataConfig(source="files", train=train, test=train), seed=0)
    assert data.train[0]["answer"] == "1200"
    msgs = prepare(DataConfig(source="files", train=test, test=test, fields={"messages": "messages"}), seed=0)
    assert msgs.test[0]["answer"] == "7"


def test_chat_rows_with_tool_turns_load_and_each_bad_message_is_named(tmp_path):
    """A chat row may hold tool turns (role "tool"), as the calculator's episodes and tool-use SFT
    sets do; a message that cannot be trained on is named by its number and what is wrong with it."""
    from trainer.data import prompt_messages

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "17*3"}}</tool_call>'
    row = {"messages": [{"role": "user", "content": "What is 17*3?"}, {"role": "assistant", "content": call},
                        {"role": "tool", "content": "51"}, {"role": "assistant", "content": "#### 51"}]}
    path = _write(tmp_path / "tools.jsonl", [row])
    data = prepare(DataConfig(source="files", train=path, test=path, fields={"messages": "messages"}), seed=0)
    assert data.test[0]["messages"] == row["messages"] and data.test[0]["answer"] == "51"
    assert prompt_messages(data.test[0]) == row["messages"][:1]
    for message, named in [({"content": "q"}, "message 1: has no role; roles are system, user, assistant, tool"),
                           ({"role": "wizard", "content": "q"}, "message 1: has role 'wizard'"),
                           ({"role": "user", "content": [{"type": "text", "text": "q"}]},
                            "message 1: has content as a list of parts; write it as one string"),
                           ({"role": "user", "content": None}, "message 1: has no content"),
                           ("q", "message 1: is a str, not an object with role and content")]:
        bad = _write(tmp_path / "bad.jsonl", [{"messages": [message, {"role": "assistant", "content": "#### 1"}]}])
        with pytest.raises(DataError, match=rf"bad.jsonl row 1: field 'messages', {re.escape(named)}"):
            prepare(DataConfig(source="files", train=bad, test=bad, fields={"messages": "messages"}), seed=0)


def test_malformed_row_names_file_row_and_field(tmp_path):
    rows = [{"question": "ok", "answer": "#### 1"}, {"question": "ok", "answer": "#### 2"},
            {"question": "no answer field"}]
    path = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as exc:
        prepare(DataConfig(source="files", train=path, test=path), seed=0)
    msg = str(exc.value)
    assert "bad.jsonl row 3" in msg and "'answer'" in msg and "on_bad_row=skip" in msg


@pytest.mark.parametrize("make, named", [
    (lambda tmp: tmp, "is a folder; point it at one .jsonl, .json, .parquet or .csv file"),
    (lambda tmp: _write(tmp / "empty.jsonl", []), "is empty; it needs rows"),
    (lambda tmp: (tmp / "blank.jsonl").write_text("\n\n  \n") and str(tmp / "blank.jsonl"),
     "has no rows (only blank lines)"),
])
def test_a_data_file_without_rows_is_named(tmp_path, make, named):
    """A folder, an empty file, a file of blank lines: named with the fix (were a traceback, a message
    ending in an empty reason, and datasets' 'Instruction "train" corresponds to no data!')."""
    path = str(make(tmp_path))
    with pytest.raises(DataError, match=rf"^data.train: '{re.escape(path)}' {re.escape(named)}"):
        prepare(DataConfig(source="files", train=path, test=path), seed=0)


@pytest.mark.parametrize("answer", ["just prose", "the sum is 4 ####", "the sum is 4 #### \n", "#### ,"])
def test_row_without_final_answer(tmp_path, answer):
    path = _write(tmp_path / "x.jsonl", [{"question": "q", "answer": answer}])
    with pytest.raises(DataError, match=r"x.jsonl row 1: field 'answer' has no final answer.*####"):
        prepare(DataConfig(source="files", train=path, test=path), seed=0)


@pytest.mark.parametrize("name,make", [
    ("spaces inside the answer", lambda n: "#### 4" + " " * n + "2"),
    ("hashes", lambda n: "#" * n),
    ("a final line after prose", lambda n: "1 + 1 = 2. " * n + "\n#### 2,000 \n"),
])
def test_reading_a_rows_final_answer_is_linear_in_its_length(name, make):
    """A dataset's answer field can be as long as a file allows: its final answer is found in linear
    time (a lazy regex, `####\\s*(.+?)\\s*$`, took 0.22 s on 8,000 spaces, 4x that at twice as many)."""
    from tests.growth import assert_linear
    from trainer.data import final_answer

    assert final_answer("... #### 2,000 \n", "x.jsonl row 1", "answer") == "2000"
    assert_linear(lambda text: final_answer(text, "x.jsonl row 1", "answer"), make, 2000, f"a final answer: {name}")


def test_skip_mode_counts_bad_rows(tmp_path):
    rows = [{"question": "q", "answer": "#### 1"}, {"question": "", "answer": "#### 2"},
            {"question": "q", "answer": "none"}, {"question": "q", "answer": "#### 4"}]
    path = _write(tmp_path / "mix.jsonl", rows)
    data = prepare(DataConfig(source="files", train=path, test=path, on_bad_row="skip"), seed=0)
    assert len(data.train) == 2 and len(data.skipped) == 4  # 2 bad rows in each of train and test
    assert "row 2" in data.skipped[0] and "row 3" in data.skipped[1]


def test_missing_path_names_field_and_path(tmp_path):
    with pytest.raises(DataError, match=r"data.train: file '.*nothere.jsonl' does not exist"):
        prepare(DataConfig(source="files", train=str(tmp_path / "nothere.jsonl")), seed=0)


def test_not_json(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text("{not json\n")
    with pytest.raises(DataError, match="broken.jsonl"):
        prepare(DataConfig(source="files", train=str(path), test=str(path)), seed=0)


def test_a_line_that_is_not_json_is_named_by_its_number_in_the_whole_file(tmp_path):
    """pyarrow's own message counts rows within a block of the file ("in row 1"); the error names the
    line in the whole file, and what is wrong with it."""
    good = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(20_000)]
    path = _write(tmp_path / "big.jsonl", good + ['{"question": "q", "answer": "#### 1"'] + good[:5])
    with pytest.raises(DataError, match=r"data.train: .*big.jsonl line 20001: Expecting ',' delimiter \(column 37\); fix it"):
        prepare(DataConfig(source="files", train=path, test=path), seed=0)
    path = _write(tmp_path / "list.jsonl", good[:3] + ["[1, 2]"])
    with pytest.raises(DataError, match=r"list.jsonl line 4: a JSON list, not an object"):
        prepare(DataConfig(source="files", train=path, test=path), seed=0)


def test_a_json_array_file_names_its_bad_line_or_element(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[{"question": "q", "answer": "#### 1"},\n {"question": "q" "answer": "#### 2"}]\n')
    with pytest.raises(DataError, match=r"rows.json line 2: Expecting ',' delimiter \(column 19\)"):
        prepare(DataConfig(source="files", train=str(path), test=str(path)), seed=0)
    path.write_text('[{"question": "q", "answer": "#### 1"},\n 3]\n')
    with pytest.raises(DataError, match=r"rows.json element 2 of its array is a JSON int, not an object"):
        prepare(DataConfig(source="files", train=str(path), test=str(path)), seed=0)


def test_bytes_that_are_not_utf8_name_the_row(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "#### 1"}\n{"question": "caf\xe9?", "answer": "#### 2"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl row 2: not UTF-8 text .*save the file as UTF-8"):
        prepare(DataConfig(source="files", train=str(path), test=str(path)), seed=0)


def test_a_field_that_is_not_text_says_so(tmp_path):
    path = _write(tmp_path / "typed.jsonl", [{"question": "q", "answer": "#### 1"},
                                             {"question": "q", "answer": {"value": 2}}])
    with pytest.raises(DataError, match=r"typed.jsonl row 2: field 'answer' is a dict, not text"):
        prepare(DataConfig(source="files", train=path, test=path), seed=0)


GSM8K = Path(__file__).parent / "data" / "gsm8k"


def test_real_gsm8k_sample():
    """Real GSM8K rows parse with the GPU preset's field mapping; ids carry no machine path."""
    cfg = DataConfig(source="files", train=str(GSM8K / "train.jsonl"), test=str(GSM8K / "test.jsonl"),
                     max_train=50, max_test=20)
    data = prepare(cfg, seed=0)
    assert len(data.train) == 50 and len(data.test) == 20
    assert all(re.fullmatch(r"-?[\d.]+", ex["answer"]) for ex in data.train)
    assert data.train[0]["id"] == "train-1" and data.test[19]["id"] == "test-20"
    assert data.train[0]["answer"] == "72"
    assert "<<48/2=24>>" in data.train[0]["messages"][-1]["content"]  # kept by default


def _gsm8k_as(path: Path, n: int, sep: str = ",", encoding: str = "utf-8") -> str:
    """The first n rows of real GSM8K written as CSV (or TSV): answers span several lines, quoted."""
    import csv

    rows = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()[:n]]
    with open(path, "w", newline="", encoding=encoding) as fh:
        writer = csv.DictWriter(fh, fieldnames=["question", "answer"], delimiter=sep)
        writer.writeheader()
        writer.writerows({"question": r["question"], "answer": r["answer"]} for r in rows)
    return str(path)


def test_csv_and_tsv_files_give_the_examples_the_jsonl_does(tmp_path):
    """Real GSM8K as .csv, .tsv and a spreadsheet's UTF-8 export (a byte-order mark before the
    header): the same examples, ids included, as from its JSON Lines file."""
    jsonl = str(GSM8K / "train.jsonl")
    want = prepare(DataConfig(source="files", train=jsonl, test=jsonl, max_train=40, max_test=40), seed=0)
    for path in (_gsm8k_as(tmp_path / "g.csv", 40), _gsm8k_as(tmp_path / "g.tsv", 40, "\t"),
                 _gsm8k_as(tmp_path / "excel.csv", 40, encoding="utf-8-sig")):
        got = prepare(DataConfig(source="files", train=path, test=path), seed=0)
        assert (got.train, got.test) == (want.train, want.test), path
    assert "\n" in want.train[0]["messages"][-1]["content"]  # a multi-line answer came through whole
    numbers = tmp_path / "numbers.csv"  # cells are text: an answer column of bare numbers is named as such
    numbers.write_text("question,answer\nWhat is 2+2?,4\n")
    with pytest.raises(DataError, match=r"numbers.csv row 1: field 'answer' has no final answer"):
        prepare(DataConfig(source="files", train=str(numbers), test=str(numbers)), seed=0)


@pytest.mark.parametrize("text, named", [
    ('question,answer\n"a","b #### 1"\nx,y,z\n', "bad.csv line 3: 3 fields where the header names 2; fix the file"),
    ('question,answer\n"a","b #### 1\nx,y\n', "bad.csv line 3: not CSV (unexpected end of data); fix the file"),
    ("question,answer\n", "'{path}' has a header row and no rows"),
    ("\nWhat?,#### 4\n", "bad.csv has no header row on its first line"),
])
def test_a_csv_file_that_cannot_be_read_is_named_by_line(tmp_path, text, named):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=re.escape(named.format(path=path))):
        prepare(DataConfig(source="files", train=str(path), test=str(path)), seed=0)


def test_ids_do_not_depend_on_where_the_file_lives(tmp_path):
    import shutil

    moved = tmp_path / "elsewhere" / "gsm8k.jsonl"
    moved.parent.mkdir()
    shutil.copy(GSM8K / "test.jsonl", moved)
    here = prepare(DataConfig(source="files", train=str(GSM8K / "test.jsonl"), test_size=5), seed=0)
    there = prepare(DataConfig(source="files", train=str(moved), test_size=5), seed=0)
    assert [e["id"] for e in here.train + here.test] == [e["id"] for e in there.train + there.test]
    assert not any(str(tmp_path) in e["id"] or "/" in e["id"] for e in there.train + there.test)


def test_calculator_annotations_can_be_stripped():
    cfg = DataConfig(source="files", train=str(GSM8K / "train.jsonl"), test=str(GSM8K / "test.jsonl"),
                     max_train=300, max_test=5, calculator_annotations="strip")
    data = prepare(cfg, seed=0)
    first = data.train[0]["messages"][-1]["content"]
    assert first == ("Natalia sold 48/2 = 24 clips in May.\n"
                     "Natalia sold 48+24 = 72 clips altogether in April and May.\n#### 72")
    assert not any("<<" in ex["messages"][-1]["content"] for ex in data.train)
    kept = prepare(cfg.model_copy(update={"calculator_annotations": "keep"}), seed=0)
    assert [e["answer"] for e in kept.train] == [e["answer"] for e in data.train]  # gold answers unchanged


def test_a_hub_dataset_this_machine_cannot_reach_is_named_at_once(monkeypatch, caplog):
    """data.source=hub where the hub cannot be reached (its address refused here): `datasets` is asked
    for its cached copy alone and the stage fails at once naming why, not after the hub client's
    retries (about 30 s of them, logged as "Retrying in ...")."""
    import logging

    import huggingface_hub.constants

    from trainer.config import DataConfig
    from trainer.data import DataError, prepare

    import datasets

    before = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    cfg = DataConfig(source="hub", hub_name="posttrain-tests/no-such-dataset")
    with caplog.at_level(logging.WARNING), pytest.raises(DataError) as err:
        prepare(cfg, 0)
    assert str(err.value).startswith(
        "data.hub_name: could not load posttrain-tests/no-such-dataset[train]: the hub cannot be reached from here "
        "(ConnectError") and "this machine's datasets cache holds no copy" in str(err.value)
    assert "Retrying" not in caplog.text
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == before  # as they were
