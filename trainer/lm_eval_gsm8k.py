"""GSM8K scored as lm-evaluation-harness scores it: its `gsm8k` task's two filters and its metric.

Read from lm-evaluation-harness's `lm_eval/tasks/gsm8k/gsm8k.yaml` (task version 3.0, the file as of
commit b733598 of January 2026, package 0.4.13.dev0) and `lm_eval/filters/extraction.py`:

- strict-match: the regex `#### (\\-?[0-9\\.\\,]+)`, its FIRST match (`take_first` after `findall`,
  `group_select` 0); no match gives "[invalid]".
- flexible-extract: the regex `(-?[$0-9.,]{2,})|(-?[0-9]+)`, its LAST match (`group_select: -1`),
  the first non-empty of its two groups, stripped.
- exact_match, on the extracted answer and on the gold answer text alike: remove `,`, remove `$`,
  remove `(?s).*#### ` (everything up to the last `#### `), remove a final `.` (`\\.$`), in that order,
  then lower-case (`ignore_case: true`); correct when the two strings are equal.

The harness generates until "Question:" (it prompts "Question: ...\\nAnswer:"); posttrain's prompts
are chat turns that end at the model's end-of-turn token, so a response is scored whole.

Every step is linear in the response's length: `(?s).*#### ` by re.sub retries `.*` from each
position (quadratic on a long string without `#### `), so it is computed as what it leaves, the
text after the last `#### `.
"""

from __future__ import annotations

import re

STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
FINAL_DOT_RE = re.compile(r"\.$")
INVALID = "[invalid]"


def extract(response: str, mode: str) -> str:
    """The answer lm-eval's filter `mode` (strict or flexible) takes from a response, or "[invalid]"."""
    if mode == "strict":
        m = STRICT_RE.search(response)  # findall()[0] is the first match
        return m.group(1).strip() if m else INVALID
    if mode != "flexible":
        raise ValueError(f"unknown lm-eval GSM8K filter {mode!r}; use strict or flexible")
    last = None
    for last in FLEXIBLE_RE.finditer(response):
        pass
    if last is None:
        return INVALID
    return (last.group(1) or last.group(2)).strip()


def normalised(text: str) -> str:
    """exact_match's regexes_to_ignore (`,`, `\\$`, `(?s).*#### `, `\\.$`) and ignore_case, in order."""
    text = text.replace(",", "").replace("$", "")
    at = text.rfind("#### ")
    if at >= 0:
        text = text[at + 5:]
    return FINAL_DOT_RE.sub("", text).lower()


def scored(response: str, gold: str, mode: str) -> tuple[str, bool]:
    """The response's `mode` answer and lm-eval's exact_match of it against `gold` (the answer column's
    text, whole or its final answer: the `#### ` rule reduces both to the same string)."""
    answer = extract(response, mode)
    return answer, normalised(answer) == normalised(gold)


def correct(response: str, gold: str, mode: str) -> bool:
    return scored(response, gold, mode)[1]
