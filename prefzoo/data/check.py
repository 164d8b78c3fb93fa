"""A first pass over a run's data file, made by the command line right after the config is validated: before
the training loop and its model libraries are even imported, so that a bad file fails in seconds.

It reads the file (:func:`prefzoo.data.files.read_file`, shared with the run's own data set-up, which reads it
from the cache) and judges each row by the same rules as the tokenisers, in file order: an online algorithm's
prompts (:func:`prefzoo.data.files.prompt_problem`), an offline algorithm's preference pairs
(:func:`prefzoo.data.preference.normalise_row`), for a plugin that trains on unpaired rows the unpaired rows of
a file in that format (:func:`prefzoo.data.unpaired.normalise_unpaired_row`; a preference file is split into them),
or for one that trains on supervised sequences (SFT) the rows of the file's format (:func:`prefzoo.data.sft.sft_format`,
:func:`prefzoo.data.sft.normalise_sft_row`). What needs the tokenizer (prompt lengths) is left to the run.
Hugging Face datasets and dataset folders are left to the run too.
"""

from __future__ import annotations

import os

from prefzoo.data.files import (FILE_TYPES, ORIGIN, bad_row_error, held_out_size, prompt_problem, read_file,
                                row_label, row_problem)
from prefzoo.data.preference import normalise_row
from prefzoo.data.sft import normalise_sft_row, sft_format
from prefzoo.data.unpaired import check_one_format, is_unpaired, normalise_unpaired_row
from prefzoo.errors import DataError


def check_data_file(cfg, online: bool, data: str = "pairs", loss=None) -> None:
    """Raise what the run's data set-up would raise for ``cfg.data.path`` before it tokenises.

    Raises:
        DataError: the file cannot be read, holds too few rows to hold some out, lacks the ``prompt`` column an
            online algorithm needs, has a bad row (``data.on_bad_row=error``) or no good one (``skip``).

    ``data``: what an offline plugin trains on (its declaration's ``data``: ``pairs``, ``unpaired`` or
    ``sequences``); ``loss``: a ``sequences`` plugin's declared :class:`~prefzoo.types.LossTokens`.
    """
    d = cfg.data
    if not d.path or os.path.splitext(d.path)[1].lower() not in FILE_TYPES:
        return
    table = read_file(d.path)
    if not d.eval_split:
        held_out_size(table.num_rows, d.eval_fraction, d.path)
    if online and "prompt" not in table.column_names:
        columns = [c for c in table.column_names if c != ORIGIN]
        raise DataError(f"{d.path} has no 'prompt' column (columns: {columns}). Online algorithms need a prompt per "
                        "row; rename the column or choose another data set.")
    others = [c for c in table.column_names if c not in ("prompt", ORIGIN)]
    sequences = not online and data == "sequences"
    fmt = sft_format(table.column_names, d.path) if sequences else None
    if not online and not sequences:
        check_one_format(table.column_names, d.path)
    unpaired = not online and data == "unpaired" and is_unpaired(table.column_names)
    good = 0
    for index, row in enumerate(table):
        try:
            if online:
                problem = row_problem(row, ["prompt", *others]) or prompt_problem(row["prompt"])
                if problem is not None:
                    raise ValueError(problem)
            elif sequences:
                normalise_sft_row(row, fmt, index, loss is None or loss.assistant_only_loss)
            elif unpaired:
                normalise_unpaired_row(row)
            else:
                normalise_row(row, index)
        except ValueError as err:
            if d.on_bad_row != "skip":
                raise bad_row_error(d.path, row_label(row, index), err) from None
            continue
        good += 1
    if not good:
        columns = ('prompt' if online else f"of the {fmt} format" if sequences else 'prompt/completion/label' if unpaired
                   else 'prompt/chosen/rejected')
        raise DataError(f"{d.path}: no usable rows ({table.num_rows} bad). Check the columns {columns}.")
