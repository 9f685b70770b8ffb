"""Datasets: a synthetic GSM8K-style generator and real datasets, normalised to chat examples.

Every example becomes {"id", "messages": [system?, user, assistant], "answer"} where "answer" is
the gold final answer (for math, the text after `####`; for another task, as its grader reads it:
trainer/problems). Real data comes through `datasets` from local
jsonl/json/parquet/csv/tsv, an `s3://` URI (s3fs), or a hub name. A malformed row raises `DataError`
naming the file, row and field, or is skipped and counted when `on_bad_row: skip`.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from trainer.config import DataConfig, SyntheticData
from trainer.errors import InputError

CALCULATOR_RE = re.compile(r"<<[^<>\n]*>>")  # GSM8K's calculator annotations, e.g. <<48/2=24>>


class DataError(InputError):
    """Bad input data; the message names the file, row and field and how to fix it."""


@dataclass
class PreparedData:
    train: list[dict[str, Any]]
    test: list[dict[str, Any]]
    skipped: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- synthetic task

NAMES = ["Ann", "Ben", "Cal", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jo"]
ITEMS = ["apples", "books", "coins", "eggs", "pens", "cards", "shells", "cups"]
ADD = ["{p} buys {n} more.", "{p} finds {n} more.", "{p} gets {n} more."]
SUB = ["{p} gives away {n}.", "{p} loses {n}.", "{p} sells {n}."]
MUL = ["{p} then has {n} times as many.", "The pile grows {n} times bigger."]


def generate_problem(rng: random.Random, cfg: SyntheticData) -> tuple[str, str, str, tuple]:
    """One word problem: (question, step-by-step answer ending in `#### n`, final answer,
    equation). The equation is (start value, (op, operand), ...): what the problem computes,
    whatever its names and wording."""
    lo, hi = (1 if cfg.digits == 1 else 10 ** (cfg.digits - 1)), 10**cfg.digits - 1
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(lo, hi)
    sentences = [f"{name} has {value} {item}."]
    steps = []
    equation: list = [value]
    for _ in range(rng.randint(cfg.min_ops, cfg.max_ops)):
        op = rng.choice(cfg.ops)
        if op == "-" and value < lo:
            op = "+"  # keep counts non-negative: nothing to take away
        n = rng.randint(lo, min(hi, value)) if op == "-" else rng.randint(max(lo, 2) if op == "*" else lo, hi)
        template = {"+": ADD, "-": SUB, "*": MUL}[op]
        sentences.append(rng.choice(template).format(p=name, n=n))
        new = value + n if op == "+" else value - n if op == "-" else value * n
        steps.append(f"{value}{op}{n}={new}")
        equation.append((op, n))
        value = new
    question = " ".join(sentences) + f" How many {item} does {name} have now?"
    answer = "\n".join(steps) + f"\n#### {value}"
    return question, answer, str(value), tuple(equation)


STALE_DRAWS = 100_000


def held_out_equation(equation: tuple, seed: int, fraction: float) -> bool:
    """Whether an equation belongs to the held-out side: a hash of (seed, equation), so the choice
    is independent of how often the generator draws it and of its shape; every shape (number of
    steps, operations) keeps the same share of held-out equations in expectation."""
    digest = hashlib.sha256(repr((seed, equation)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def synthetic(cfg: SyntheticData, seed: int) -> PreparedData:
    """Deterministic train/test sets split by equation: a held-out problem's equation (start value,
    every operation and operand; for code, every operation and operand of the function) never
    appears in training, whatever the names and wording.

    Problems come from one generator stream; each goes to the side its equation belongs to
    (held_out_equation), so both sides keep the generator's mix of steps and operations. Test
    questions are distinct; the same held-out equation may recur in test with other words."""
    if cfg.family == "code":
        from trainer.problems import code

        def draw(rng: random.Random):
            q, worked, direct, equation, fields = code.generate_problem(rng, cfg)
            terse = lambda style: style is not None and style >= cfg.worked_fraction  # noqa: E731
            return q, equation, lambda ex_id, style: {
                **make_example(ex_id, q, direct if terse(style) else worked, worked), **fields}
    else:
        def draw(rng: random.Random):
            q, a, final, equation = generate_problem(rng, cfg)

            def example(ex_id: str, style: float | None) -> dict[str, Any]:
                if style is not None and style < cfg.tool_fraction:
                    return tool_example(ex_id, q, equation, final)
                short = style is not None and style >= cfg.tool_fraction + (1 - cfg.tool_fraction) * cfg.worked_fraction
                return make_example(ex_id, q, f"#### {final}" if short else a, final)

            return q, equation, example
    return _split_by_equation(cfg, seed, draw)


def _split_by_equation(cfg: SyntheticData, seed: int, draw) -> PreparedData:
    """`draw(rng)` -> (question, equation, example(id, style draw or None for a held-out one))."""
    rng = random.Random(seed)
    style = random.Random(f"{seed}/answer-style")  # its own stream: the questions do not depend on it
    seen: set[str] = set()
    test: list[dict[str, Any]] = []
    train: list[dict[str, Any]] = []
    stale = 0  # draws since the last one kept
    while len(test) < cfg.n_test or len(train) < cfg.n_train:
        stale += 1
        if stale > STALE_DRAWS:
            raise DataError(
                f"data.synthetic: only {len(test)} distinct held-out problems (of n_test={cfg.n_test}) and "
                f"{len(train)} training problems (of n_train={cfg.n_train}) were found: no new one in "
                f"{STALE_DRAWS} draws, so these settings have no more distinct problems; raise digits or max_ops, "
                "or lower n_train/n_test"
            )
        q, equation, example = draw(rng)
        if held_out_equation(equation, seed, cfg.held_out_fraction):
            if len(test) >= cfg.n_test or q in seen:
                continue
            seen.add(q)
            test.append(example(f"syn-{len(test)}", None))
            stale = 0
            continue
        if len(train) >= cfg.n_train:
            continue
        stale = 0
        train.append(example(f"syn-{len(train)}", style.random()))
    return PreparedData(train=train, test=test)


def expression(equation: tuple) -> str:
    """An equation (start, (op, n), ...) as one arithmetic expression, parenthesised where needed."""
    text = str(equation[0])
    for op, n in equation[1:]:
        if op == "*" and ("+" in text or "-" in text):
            text = f"({text})"
        text = f"{text}{op}{n}"
    return text


def tool_example(ex_id: str, question: str, equation: tuple, final: str) -> dict:
    """A training conversation that uses the calculator: one call with the whole expression, the
    tool's answer, then the final answer."""
    import json

    call = json.dumps({"name": "calculator", "arguments": {"expression": expression(equation)}})
    messages = [{"role": "user", "content": question},
                 {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                 {"role": "tool", "content": final},
                 {"role": "assistant", "content": f"#### {final}"}]
    return {"id": ex_id, "messages": messages, "answer": final}


def make_example(ex_id: str, question: str, answer: str, final: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"id": ex_id, "messages": messages, "answer": final}


# ---------------------------------------------------------------- real datasets

def _hub_unreachable(name: str) -> str | None:
    """Why the hub cannot be asked about dataset `name` from here (asked once, no retries), or None:
    it answered (whatever it said, `datasets` reports), or offline mode is on (`datasets` keeps to its
    cache then). Unasked, `datasets` waits out the hub client's retries, about 30 s, before its cache."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        HfApi().dataset_info(name, timeout=10)
    except HfHubHTTPError:
        return None
    except Exception as exc:  # the network: DNS, refused, timed out
        return f"{type(exc).__name__}: {exc}"
    return None


@contextlib.contextmanager
def _offline(on: bool):
    """`datasets` and the hub client in offline mode for one load: the copy in this machine's cache."""
    if not on:
        yield
        return
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _load_rows(cfg: DataConfig, which: str) -> tuple[str, Iterable[dict[str, Any]]]:
    """(label for errors, rows) for the train or test part, through `datasets`."""
    import datasets

    if cfg.source == "hub":
        split = cfg.hub_train_split if which == "train" else cfg.hub_test_split
        label = f"{cfg.hub_name}[{split}]"
        unreachable = _hub_unreachable(cfg.hub_name)
        try:
            with _offline(unreachable is not None):  # this machine's datasets cache, without the hub's retries
                ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=split)
        except Exception as exc:  # the hub or a network can fail in many ways
            why = (f"the hub cannot be reached from here ({unreachable}), and this machine's datasets cache holds "
                   "no copy" if unreachable is not None else str(exc))
            raise DataError(f"data.hub_name: could not load {label}: {why}. Check the name, "
                            "or download it and use source=files with data.train") from None
        return label, ds
    path = cfg.train if which == "train" else cfg.test
    assert path is not None
    from trainer.storage import exists

    if not exists(path):
        raise DataError(f"data.{which}: file {path!r} does not exist; fix the path or URI")
    problem = _not_a_rows_file(path)
    if problem:
        raise DataError(f"data.{which}: {path!r} {problem}")
    name = path.lower()
    if name.endswith((".csv", ".tsv")):
        return path, _csv_rows(path, which, "\t" if name.endswith(".tsv") else ",")
    fmt = "parquet" if name.endswith(".parquet") else "json"
    try:
        ds = datasets.load_dataset(fmt, data_files={which: path}, split=which,
                                   storage_options=_storage_options(path))
    except Exception as exc:
        where = _json_problem(path) if fmt == "json" else None
        if where is not None:
            raise DataError(f"data.{which}: {path} {where}; fix it (each line of a .jsonl file is "
                            "one JSON object; a .json file may instead hold one array of objects)") from None
        cause = _root_cause(exc)
        if "corresponds to no data" in cause:  # datasets' words for a file of blank lines
            raise DataError(f"data.{which}: {path!r} has no rows (only blank lines); it needs rows (a .jsonl "
                            "file holds one JSON object per line)") from None
        raise DataError(f"data.{which}: could not read {path!r} as {fmt}: {cause}; "
                        "use jsonl (one JSON object per line), json, parquet or csv") from None
    return path, ds


def _csv_rows(path: str, which: str, sep: str) -> Iterator[dict[str, str]]:
    """The rows of a CSV (or, with a tab as `sep`, TSV) file with a header row, as dicts of text
    (a column of numbers, or an id, stays as written), read as they are used. A row whose field
    count differs from the header's, or a quote left open, stops with its line number and the fix;
    blank lines are skipped; a byte-order mark (a spreadsheet's export) is not part of a name."""
    import csv

    from trainer.storage import fs_for

    kind = "TSV" if sep == "\t" else "CSV"
    fix = (f"fix the file: a header row naming the columns, then one row per problem, text that holds "
           f"{'a tab' if sep == chr(9) else 'a comma'}, a quote or a line break in double quotes")
    fs, p = fs_for(path)
    with fs.open(p, "r", encoding="utf-8-sig", newline="") as fh:
        reader = csv.reader(fh, delimiter=sep, strict=True)
        try:
            header = next(reader, None)
            if not header or not any(h.strip() for h in header):
                raise DataError(f"data.{which}: {path} has no header row on its first line; {fix}")
            n = 0
            for fields in reader:
                if not fields:
                    continue
                if len(fields) != len(header):
                    raise DataError(f"data.{which}: {path} line {reader.line_num}: {len(fields)} fields where the "
                                    f"header names {len(header)}; {fix}")
                n += 1
                yield dict(zip(header, fields))
        except csv.Error as exc:
            raise DataError(f"data.{which}: {path} line {reader.line_num}: not {kind} ({exc}); {fix}") from None
    if not n:
        raise DataError(f"data.{which}: {path!r} has a header row and no rows; it needs rows")


ROLES = ("system", "user", "assistant", "tool")  # "tool": a tool's answer, as the calculator's episodes have


def _message_problem(m: Any) -> str | None:
    """What keeps one message of a chat row from being trained on, or None."""
    if not isinstance(m, dict):
        return f"is a {type(m).__name__}, not an object with role and content"
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        return ("has no role" if role is None else f"has role {role!r}") + f"; roles are {', '.join(ROLES)}"
    if isinstance(content, list):
        return "has content as a list of parts; write it as one string"
    if not isinstance(content, str):
        return "has no content" if content is None else f"has content of type {type(content).__name__}, not a string"
    return None


def _not_a_rows_file(path: str) -> str | None:
    """What is wrong with a data file that exists, before `datasets` reads it (it answers a folder
    with a traceback, an empty file with an empty message), or None."""
    from trainer.storage import fs_for

    fs, p = fs_for(path)
    if fs.isdir(p):
        return "is a folder; point it at one .jsonl, .json, .parquet or .csv file"
    if not fs.size(p):
        return "is empty; it needs rows (a .jsonl file holds one JSON object per line)"
    return None


def _root_cause(exc: BaseException) -> str:
    """`exc` and what caused it, innermost last (datasets wraps pyarrow's reason in a generic error)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).strip()
        if text and text not in parts:
            parts.append(text)
        exc = exc.__cause__ or exc.__context__
    return ": ".join(parts)


def _json_problem(path: str) -> str | None:
    """Where a JSON Lines file (or a .json file holding one array) stops being rows: 'line N: why'
    (N counted from 1 over the whole file), or None when every row is a JSON object. One pass over
    the file, a line at a time."""
    import json

    from trainer.storage import fs_for

    fs, p = fs_for(path)
    with fs.open(p, "rb") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith(b"["):  # one JSON document: its parser names the line and column
        try:
            with fs.open(p, "rb") as fh:
                rows = json.load(fh)
        except UnicodeDecodeError as exc:
            return f"is not UTF-8 text ({exc.reason} at byte {exc.start})"
        except json.JSONDecodeError as exc:
            return f"line {exc.lineno}: {exc.msg} (column {exc.colno})"
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
        return None if bad is None else f"element {bad + 1} of its array is a JSON {type(rows[bad]).__name__}, not an object"
    with fs.open(p, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                return f"line {number}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line)"
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                return f"line {number}: {exc.msg} (column {exc.colno})"
            if not isinstance(row, dict):
                return f"line {number}: a JSON {type(row).__name__}, not an object"
    return None


def _storage_options(path: str) -> dict[str, Any] | None:
    from trainer.storage import storage_options

    return storage_options(path) or None


RESERVED = ("id", "messages", "answer")  # an example's own keys; the row's other columns are kept beside them


def normalise(label: str, index: int, row: dict[str, Any], cfg: DataConfig, which: str = "train",
              task=None) -> dict[str, Any]:
    """One raw row -> example; raises DataError naming the file, row and field.

    The id is the row's own `id` field, else `<split>-<row number>`: the same wherever the file
    lives (a machine path would end up in MLflow tables and differ between machines). The gold
    answer is read as `task` (a trainer.problems.Task; None: math) needs it, and the row's other
    columns are kept in the example for its grader (a code row's `entry` and `tests`)."""
    answer_of = task.answer_of if task is not None else final_answer
    example = _normalised(label, index, row, cfg, which, answer_of)
    if task is None or task.is_math:
        return example
    f = cfg.fields  # another task's grader may read any of the row's columns
    used = {f.question, f.answer, f.messages}
    example.update({k: v for k, v in row.items() if k not in used and k not in RESERVED})
    task.check_row(example, f"{label} row {index + 1}")
    return example


def _normalised(label: str, index: int, row: dict[str, Any], cfg: DataConfig, which: str,
                answer_of: Callable[[str, str, str], str]) -> dict[str, Any]:
    where = f"{label} row {index + 1}"
    f = cfg.fields
    ex_id = str(row["id"]) if row.get("id") is not None else f"{which}-{index + 1}"
    if f.messages:
        msgs = row.get(f.messages)
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: field {f.messages!r} must be a non-empty list of messages")
        for n, m in enumerate(msgs, 1):
            problem = _message_problem(m)
            if problem:
                raise DataError(f"{where}: field {f.messages!r}, message {n}: {problem}")
        if msgs[-1]["role"] != "assistant":
            raise DataError(f"{where}: field {f.messages!r} must end with an assistant message")
        final = answer_of(msgs[-1]["content"], where, f.messages)
        if cfg.calculator_annotations == "strip":
            msgs = msgs[:-1] + [{**msgs[-1], "content": strip_calculator(msgs[-1]["content"])}]
        return {"id": ex_id, "messages": msgs, "answer": final}
    for name in (f.question, f.answer):
        value = row.get(name)
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}: field {name!r} is a {type(value).__name__}, not text; "
                            "fix the row, or set data.fields to the column that holds the text")
        if value is None or not value.strip():
            present = sorted(row)
            raise DataError(f"{where}: field {name!r} is missing or empty (row has {present}); "
                            "set data.fields to the right column names or fix the row")
    final = answer_of(row[f.answer], where, f.answer)
    answer = row[f.answer].strip()
    if cfg.calculator_annotations == "strip":
        answer = strip_calculator(answer)
    example = make_example(ex_id, row[f.question].strip(), answer, final, cfg.system_prompt)
    if cfg.calculator_annotations == "tool":
        example["messages"] = example["messages"][:-1] + calculator_turns(answer)
    return example


def strip_calculator(text: str) -> str:
    """'48/2 = <<48/2=24>>24 clips' -> '48/2 = 24 clips'."""
    return CALCULATOR_RE.sub("", text)


def calculator_turns(answer: str) -> list[dict[str, str]]:
    """A GSM8K answer with its calculator annotations as tool calls: '48/2 = <<48/2=24>>24 clips'
    becomes the assistant's '48/2 = <tool_call>{...48/2...}</tool_call>', the tool's '24', and the
    assistant's '24 clips'. The tool's answer is the calculator environment's own (what RL will
    show); an annotation it cannot evaluate is dropped from the text instead."""
    import json

    from trainer.rl.tools import TOOL_CALL_END, TOOL_CALL_START, CalculatorError, calculate

    turns: list[dict[str, str]] = []
    text, pos = "", 0
    for m in CALCULATOR_RE.finditer(answer):
        text += answer[pos : m.start()]
        pos = m.end()
        expr = m.group(0)[2:-2].rpartition("=")[0]
        try:
            result = calculate(expr)
        except CalculatorError:
            continue
        call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
        turns += [{"role": "assistant", "content": f"{text}{TOOL_CALL_START}{call}{TOOL_CALL_END}"},
                  {"role": "tool", "content": result}]
        text = ""
    return turns + [{"role": "assistant", "content": text + answer[pos:]}]


def final_answer(text: str, where: str, field_name: str) -> str:
    hashes = text.find("####")  # what follows the first `####`, to the end (a string scan: linear time)
    final = text[hashes + 4:].strip().replace(",", "").strip() if hashes >= 0 else ""
    if final:
        return final
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    raise DataError(f"{where}: field {field_name!r} has no final answer; it must end with "
                    "'#### <answer>' (GSM8K) or contain \\boxed{<answer>}")


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def _decoded(label: str, rows: Iterable[dict]) -> Iterable[dict]:
    """`rows`, stopping with the row's number when one holds bytes that are not UTF-8 (the loader
    takes them in and only fails when the row is read)."""
    it, number = iter(rows), 0
    while True:
        number += 1
        try:
            row = next(it)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            raise DataError(f"{label} row {number}: not UTF-8 text ({exc.reason}); save the file as UTF-8") from None
        yield row


def _normalise_all(label: str, rows: Iterable[dict], cfg: DataConfig, limit: int | None,
                   skipped: list[str], which: str, task=None) -> list[dict[str, Any]]:
    out = []
    for i, row in enumerate(_decoded(label, rows)):
        if limit is not None and len(out) >= limit:
            break
        try:
            out.append(normalise(label, i, row, cfg, which, task))
        except DataError as exc:
            if cfg.on_bad_row == "error":
                raise DataError(f"{exc} (or set data.on_bad_row=skip to drop such rows)") from None
            skipped.append(str(exc))
    if not out:
        raise DataError(f"{label}: no usable rows; check data.fields against the file's columns")
    return out


def prepare(cfg: DataConfig, seed: int, task=None) -> PreparedData:
    """Build the normalised train/test sets for a data config (deterministic for a seed), each row's
    answer read as `task` (a trainer.problems.Task; default math) needs it."""
    if cfg.source == "synthetic":
        data = synthetic(cfg.synthetic, seed)
        if cfg.system_prompt:
            for ex in data.train + data.test:
                ex["messages"].insert(0, {"role": "system", "content": cfg.system_prompt})
        return data
    skipped: list[str] = []
    label, rows = _load_rows(cfg, "train")
    train = _normalise_all(label, rows, cfg, None, skipped, "train", task)
    dev: list[dict[str, Any]] = []
    if cfg.dev_size:  # set aside before anything else reads train: the same training rows either way
        if cfg.dev_size >= len(train):
            raise DataError(f"data.dev_size={cfg.dev_size} leaves no training rows out of {len(train)}; lower it")
        picked = set(random.Random(f"{seed}/dev").sample(range(len(train)), cfg.dev_size))
        dev = [ex for i, ex in enumerate(train) if i in picked]
        train = [ex for i, ex in enumerate(train) if i not in picked]
    has_test = cfg.test is not None if cfg.source == "files" else cfg.hub_test_split is not None
    if cfg.held_out == "dev":
        test = dev
    elif has_test:
        tlabel, trows = _load_rows(cfg, "test")
        test = _normalise_all(tlabel, trows, cfg, cfg.max_test, skipped, "test", task)
    else:
        if cfg.test_size >= len(train):
            raise DataError(f"data.test_size={cfg.test_size} leaves no training rows out of "
                            f"{len(train)}; lower it or give data.test")
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        test = [train[i] for i in order[: cfg.test_size]]
        train = [train[i] for i in sorted(order[cfg.test_size :])]
    if cfg.max_train is not None:
        train = train[: cfg.max_train]
    if cfg.max_test is not None:
        test = test[: cfg.max_test]
    if cfg.test_sample is not None and cfg.test_sample < len(test):
        picked = set(random.Random(f"{seed}/test-sample").sample(range(len(test)), cfg.test_sample))
        test = [ex for i, ex in enumerate(test) if i in picked]
    return PreparedData(train=train, test=test, skipped=skipped)


def prompt_messages(example: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation up to (not including) its first assistant turn: what a policy answers."""
    messages = example["messages"]
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return messages[:first]


def question_of(example: dict[str, Any]) -> str:
    """The text of the prompt's last message (the user's question)."""
    return prompt_messages(example)[-1]["content"]
