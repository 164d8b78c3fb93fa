"""Reading a data file into a ``datasets.Dataset`` one row at a time, so that every complaint names the file,
the row and the line.

``datasets``' own JSON and CSV builders read a file column by column through pyarrow, falling back to pandas:
an empty file, a malformed line or a non-UTF-8 byte then ends in a pyarrow/pandas traceback that names no
line, and one non-string value in a column makes pandas coerce the whole column (a completion "118" becomes
the int 118 in every row). Here JSON Lines, JSON and CSV files are parsed in Python (Parquet files by pyarrow),
each row judged alone, and the rows handed to ``datasets.Dataset.from_dict``; Hugging Face datasets and dataset
folders are read by ``datasets.load_dataset`` as before.

Rows and lines. ``row`` counts the file's data rows from 0, as ``table[row]`` would (blank lines are no rows);
``line`` is the line of the file where the row starts, counted from 1 as editors do (a CSV header is line 1).
Every table carries the column :data:`ORIGIN` with each row's place in the file and the problems found
reading it, so that a message can name the file's own row after the table was shuffled or split (the
tokenisers drop the column). A problem of one row (a line that is not JSON, a value of a type its column
cannot hold, a key other rows have and this one lacks) makes that row a bad row, refused or skipped under
``data.on_bad_row`` like any other; problems of the whole file (no such file, not UTF-8 outside JSON Lines,
no rows at all) raise :class:`~prefzoo.errors.DataError` at once.

Columns. The text columns ``prompt``, ``chosen``, ``rejected``, ``completion``, ``text`` and ``messages`` hold a string or
a list of chat messages (which of the two a format wants is the format's check: :mod:`prefzoo.data.sft`);
a value of another type is a problem of its row, not a reason to convert the column. Other columns (e.g.
``answer``) keep their values; a column whose values one Arrow column cannot hold together (the ints 118 and
"118") is read as text, each value written as it appears in the file.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import os

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from prefzoo.errors import DataError

__all__ = ["ORIGIN", "TEXT_COLUMNS", "CHAT_ROLES", "FILE_TYPES", "read_file", "with_origin", "origin",
           "row_label", "row_problem", "text_problem", "prompt_problem", "bad_row_error", "held_out_size",
           "split_held_out"]

#: The column holding each row's place in its file and the problems found reading it (a JSON string).
ORIGIN = "_prefzoo_origin"
#: Columns that hold text: a string, or a list of chat messages ``{"role", "content"}``.
TEXT_COLUMNS = ("prompt", "chosen", "rejected", "completion", "text", "messages")
#: Roles a chat message may have.
CHAT_ROLES = ("system", "user", "assistant", "tool")
#: File extensions read from disk, and how.
FILE_TYPES = (".jsonl", ".json", ".csv", ".parquet")
WHOLE_ROW = "*"  # the problem key of a row that could not be read at all


# ------------------------------------------------------------------------------------- one value alone

def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def text_problem(name: str, value) -> str | None:
    """What is wrong with ``value`` as the text column ``name`` (a string or a list of chat messages), or None.

    A null is a problem (say so: it is not a missing column); an empty string is left to the caller (an empty
    ``chosen`` and an empty ``prompt`` have their own messages)."""
    if isinstance(value, str):
        return None
    if value is None:
        return f"{name} is null (the row has a {name!r} key but no value)"
    if isinstance(value, list):
        if not value:
            return f"{name} is an empty list of messages"
        for i, message in enumerate(value):
            if not (isinstance(message, dict) and "role" in message and "content" in message):
                return (f"{name} is a list, but its item {i} is not a chat message {{'role': ..., 'content': ...}} "
                        f"(it is {_type_name(message)} {str(message)[:60]})")
            if message["role"] not in CHAT_ROLES:
                return (f"{name} message {i} has the role {message['role']!r}; chat roles are "
                        f"{', '.join(CHAT_ROLES)}")
            if not isinstance(message["content"], str):
                return f"{name} message {i} has content of type {_type_name(message['content'])}, expected a string"
        return None
    return f"{name} is {_type_name(value)} ({str(value)[:60]}), expected a string or a list of chat messages"


def prompt_problem(prompt) -> str | None:
    """What is wrong with ``prompt`` (a string or a list of chat messages), or None: also an empty prompt."""
    problem = text_problem("prompt", prompt)
    if problem is not None:
        return problem
    if isinstance(prompt, str):
        return "prompt is empty" if not prompt.strip() else None
    if not any(m["content"].strip() for m in prompt):
        return "prompt is empty (its messages hold no text)"
    return None


# ------------------------------------------------------------------------------------------ origin

def origin(row: dict) -> dict | None:
    """``{"row", "line", "problems"}`` of a row of a table read here, or None for a table made elsewhere."""
    raw = row.get(ORIGIN) if isinstance(row, dict) else None
    return json.loads(raw) if raw else None


def row_label(row: dict, index: int) -> str:
    """"row 20 (line 21)" for a row read from a file here; "row <index>" for a table made elsewhere."""
    where = origin(row)
    if where is None:
        return f"row {index}"
    return f"row {where['row']}" + (f" (line {where['line']})" if where.get("line") is not None else "")


def row_problem(row: dict, columns) -> str | None:
    """The first problem found reading ``row`` in one of ``columns`` (or in the whole row), or None."""
    where = origin(row)
    if not where or not where["problems"]:
        return None
    problems = where["problems"]
    if WHOLE_ROW in problems:
        return problems[WHOLE_ROW]
    return next((problems[c] for c in columns if c in problems), None)


def require_columns(row: dict, columns, hint: str = "") -> None:
    """Raise ValueError for the first problem found reading ``row``'s ``columns`` (:func:`row_problem`), else for the
    first of ``columns`` the row lacks (``missing column 'x'``, then `` (hint)`` when given)."""
    problem = row_problem(row, columns)
    if problem is not None:
        raise ValueError(problem)
    for col in columns:
        if col not in row:
            raise ValueError(f"missing column {col!r}" + (f" ({hint})" if hint else ""))


def _origin_json(row: int, line: int | None, problems: dict) -> str:
    return json.dumps({"row": row, "line": line, "problems": problems})


def with_origin(table: datasets.Dataset) -> datasets.Dataset:
    """``table`` with the :data:`ORIGIN` column (its rows counted from 0, no lines), unless it has one."""
    if ORIGIN in table.column_names:
        return table
    return table.add_column(ORIGIN, [_origin_json(i, None, {}) for i in range(table.num_rows)])


# ----------------------------------------------------------------------------------------- parsing

def _decode(data: bytes, path: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise DataError(f"{path}, line {line}: byte 0x{data[err.start]:02x} at column {column} is not UTF-8 "
                        f"({err.reason}). Save the file as UTF-8.") from None


def _json_lines(data: bytes, path: str) -> list[tuple[int, dict | None, str | None]]:
    """(line, row or None, problem or None) of each non-blank line of a JSON Lines file."""
    out = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as err:
            out.append((number, None, f"byte 0x{raw[err.start]:02x} at column {err.start + 1} is not UTF-8 "
                                      f"({err.reason}); save the file as UTF-8"))
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            out.append((number, None, f"not valid JSON ({err.msg} at column {err.colno}); each line of a JSON "
                                      "Lines file holds one JSON object"))
            continue
        if not isinstance(value, dict):
            out.append((number, None, f"a JSON {_json_kind(value)}, expected an object such as "
                                      '{"prompt": ..., "chosen": ..., "rejected": ...}'))
            continue
        out.append((number, value, None))
    return out


def _json_kind(value) -> str:
    return {list: "array", dict: "object", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def _json_document(data: bytes, path: str) -> list[tuple[int | None, dict | None, str | None]]:
    """Rows of a ``.json`` file: a JSON array of objects, one object, or (as ``datasets`` reads it) JSON Lines."""
    text = _decode(data, path)
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}, line {err.lineno}: not valid JSON ({err.msg} at column {err.colno}). A .json "
                            "file holds one JSON array of objects (or one object per line).") from None
        return [(None, item, None) if isinstance(item, dict) else
                (None, None, f"item {i} of the JSON array is a {_json_kind(item)}, expected an object")
                for i, item in enumerate(value)]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:  # JSON Lines in a .json file: each line is judged alone
        return _json_lines(data, path)
    if isinstance(value, dict):
        return [(1, value, None)]
    return [(1, None, f"a JSON {_json_kind(value)}, expected an array of objects")]


_ABSENT = object()  # DictReader's value for a field a line lacks


def _csv_rows(data: bytes, path: str) -> list[tuple[int, dict | None, str | dict | None]]:
    """(line, row, problems) of each record of a CSV file; every value is text."""
    reader = csv.DictReader(io.StringIO(_decode(data, path), newline=""), restval=_ABSENT)
    out = []
    try:
        header = reader.fieldnames
        if not header:
            return []
        for row in reader:  # (DictReader skips blank lines)
            inner = sum(v.count("\n") for v in row.values() if isinstance(v, str))
            line = reader.line_num - inner  # where the record starts (a quoted value may span lines)
            if None in row:
                out.append((line, None, f"{len(header) + len(row[None])} fields where the header has "
                                        f"{len(header)} ({', '.join(header)})"))
                continue
            absent = {k: f"no {k!r} in this line (it has fewer fields than the header)"
                      for k, v in row.items() if v is _ABSENT}
            out.append((line, {k: v for k, v in row.items() if v is not _ABSENT}, absent or None))
    except csv.Error as err:
        raise DataError(f"{path}, line {reader.line_num}: not valid CSV ({err}).") from None
    return out


# --------------------------------------------------------------------------------------- the table

def _form(value) -> str:
    return "a string" if isinstance(value, str) else "a list of messages"


def _column(name: str, rows: list[dict | None], problems: list[dict]) -> list:
    """The values of column ``name``, one per row, ready for one Arrow column; adds each row's problem to
    ``problems[i]`` (a key other rows have and this row lacks; a text value of the wrong type or form, then
    replaced by None)."""
    cells, first = [], None  # first: (row, value) of the column's first good text value
    for i, row in enumerate(rows):
        if row is None:
            cells.append(None)
            continue
        if name not in row:
            problems[i].setdefault(name, f"no {name!r} in this row (other rows have one)")
            cells.append(None)
            continue
        value = row[name]
        if name in TEXT_COLUMNS and value is not None:  # (a null is named by the row checks)
            problem = text_problem(name, value)
            if problem is None and isinstance(value, str) and not value.strip():
                problem = f"{name} is empty"
            if problem is None and first is not None and _form(value) != _form(first[1]):
                problem = f"{name} is {_form(value)} but row {first[0]}'s is {_form(first[1])}; a column holds one form"
            if problem is not None:
                problems[i].setdefault(name, problem)
                value = None
            elif first is None:
                first = (i, value)
        cells.append(value)
    try:
        pa.array(cells)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        if name in TEXT_COLUMNS:
            raise
        cells = [v if v is None or isinstance(v, str) else json.dumps(v) for v in cells]  # mixed types: as text
    return cells


def _table(parsed: list[tuple[int | None, dict | None, str | dict | None]], path: str) -> datasets.Dataset:
    """The rows of a parsed file (line, row or None, its problem(s)) as a ``datasets.Dataset`` with :data:`ORIGIN`."""
    if not parsed:
        raise DataError(f"{path}: the file holds no rows (it is empty). Give a file with one row per preference "
                        "pair or prompt.")
    rows = [row for _, row, _ in parsed]
    problems = [{WHOLE_ROW: p} if isinstance(p, str) else dict(p or {}) for _, _, p in parsed]
    # (an ORIGIN column in the file, of a table saved after load_table, told where ANOTHER file's rows came from)
    columns = [k for k in dict.fromkeys(k for row in rows if row is not None for k in row) if k != ORIGIN]
    values = {}
    for name in columns:
        try:
            values[name] = _column(name, rows, problems)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
            raise DataError(f"{path}: the values of column {name!r} cannot be read as one column ({err}). Give "
                            "every message the same keys and types.") from None
    values[ORIGIN] = [_origin_json(i, line, p) for i, ((line, _, _), p) in enumerate(zip(parsed, problems))]
    return datasets.Dataset.from_dict(values)


def read_file(path: str) -> datasets.Dataset:
    """A local data file as a table (see :func:`_read_file`), read once per version of the file: a run's early
    check (:mod:`prefzoo.data.check`) and its data set-up share it."""
    try:
        stat = os.stat(path)
    except OSError:
        return _read_file(path)
    return _read_file_once(os.path.abspath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, path)


@functools.lru_cache(maxsize=4)
def _read_file_once(_abspath: str, _inode: int, _size: int, _mtime_ns: int, path: str) -> datasets.Dataset:
    return _read_file(path)


def _read_file(path: str) -> datasets.Dataset:
    """A local ``.jsonl``/``.json``/``.csv``/``.parquet`` file as a ``datasets.Dataset`` with :data:`ORIGIN`.

    Raises:
        DataError: no such file; the file holds no rows; it is not UTF-8 (JSON, CSV) or not valid JSON (a
            ``.json`` array) or CSV; it is not a readable Parquet file. A bad line of a JSON Lines file is a
            bad row instead (see the module docstring).
    """
    ext = os.path.splitext(path)[1].lower()
    if not os.path.isfile(path):
        raise DataError(f"data.path={path!r}: no such file. Give an existing {'/'.join(FILE_TYPES)} file.")
    if ext == ".parquet":
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow's errors for a damaged or non-Parquet file
            raise DataError(f"{path}: not a readable Parquet file ({type(err).__name__}: {err}).") from None
        return _table([(None, row, None) for row in rows], path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise DataError(f"{path}: cannot read the file ({err.strerror}).") from None
    if ext == ".jsonl":
        parsed = _json_lines(data, path)
    elif ext == ".json":
        parsed = _json_document(data, path)
    else:
        parsed = _csv_rows(data, path)
        if not parsed and data.strip():
            raise DataError(f"{path}: the file has a header line but no rows.")
    return _table(parsed, path)


def bad_row_error(source: str, where: str, problem) -> DataError:
    """The error of a bad row under ``data.on_bad_row=error``: where (file, row, line), what, and the two fixes."""
    return DataError(f"{source}, {where}: {problem}. Fix the row, or set data.on_bad_row=skip to drop bad rows.")


def held_out_size(n: int, fraction: float, source: str) -> int:
    """Rows ``train_test_split(test_size=fraction)`` holds out of ``n``: ceil(fraction * n).

    Raises:
        DataError: that leaves no row to train on.
    """
    held = math.ceil(fraction * n)
    if n - held < 1:
        raise DataError(f"{source} has {n} row{'s' if n != 1 else ''}: too few to hold out data.eval_fraction="
                        f"{fraction} of them ({held}) and train on the rest. Give at least {held + 1} rows, or "
                        "a separate held-out split with data.eval_split.")
    return held


def split_held_out(table: datasets.Dataset, fraction: float, seed: int, source: str):
    """(train, held-out) parts of ``table``, as ``table.train_test_split(test_size=fraction, seed=seed)`` makes
    them, after checking that both get a row (the held-out part holds ceil(fraction * n) rows).

    Raises:
        DataError: the table is too small to hold out a part and train on the rest.
    """
    held_out_size(table.num_rows, fraction, source)
    parts = table.train_test_split(test_size=fraction, seed=seed)
    return parts["train"], parts["test"]
