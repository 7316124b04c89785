"""Compile specs of kernels/row_split.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

from sparseffn.kernels.row_split import _CLASSIFY_ROWS, _LIST_POINTERS, _classify_rows_kernel


def compile_specs():
    """(jit_function, signature, constexprs) of the classification: overflow flags with and without the
    split list (the training forward, the flags alone), and the overflow list with the split list
    (inference) and alone."""
    overflow_pointers = {"overflow_ptr": "*u8"}
    list_pointers = {"overflow_ids_ptr": "*i32", "overflow_count_ptr": "*i32"}
    specs = []
    for flags, listed, split in ((True, False, True), (True, False, False), (False, True, True),
                                 (False, True, False)):
        pointers = {**(overflow_pointers if flags else {}), **(list_pointers if listed else {}),
                    **(_LIST_POINTERS if split else {})}
        constexprs = {"FLAGS": flags, "LIST": listed, "SPLIT": split, "PIECE": 128, "BLOCK_R": _CLASSIFY_ROWS,
                      "BLOCK_T": 32}
        for name in (*overflow_pointers, *list_pointers, *_LIST_POINTERS):
            if name not in pointers:
                constexprs[name] = None
        signature = {"counts_ptr": "*i32", **pointers, "M": "i32", "n_tiles": "i32", "slots": "i32",
                     "split_cap": "i32", **{k: "constexpr" for k in constexprs}}
        specs.append((_classify_rows_kernel, signature, constexprs))
    return specs
