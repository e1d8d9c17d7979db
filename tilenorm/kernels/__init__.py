"""Device code only: the kernel functions, nothing that launches them.

    cutile_row_norm.py          RMSNorm and LayerNorm forward and backward (cuTile): one
                                template, features as compile-time constants
    cutile_row_norm_fp8.py      the same norms with FP8 output (per-tensor, row, 1 x 128 and
                                MX block scales), FP8 input and the FP8-input backward
    cutile_column_sums.py       the fixed-order reduction of the backward's partial buffer
    cute_row_norm_forward.py    a row-norm forward in the CuTe DSL: a one-shot grid, whole
                                rows a CTA
    cute_cluster_norm_forward.py  the same for rows too wide for one CTA: a row across a
                                cluster of CTAs, each slice staged in shared memory
    cute_row_norm_backward.py   a row-norm backward in the CuTe DSL, loads in flight across rows
    cute_cluster_norm_backward.py  the RMSNorm backward of rows too wide for one CTA: a row
                                across a cluster of CTAs, read once
    cute_row_norm_fp8.py        the FP8-output row-norm forward in the CuTe DSL
    cute_rows.py                what the CuTe DSL row kernels share: the thread layout

What is validated on a GPU is this folder and the settings (tilenorm/settings.py, settings_fp8.py):
tilenorm.validation pins their digest. tilenorm.launch binds plans to these kernels.
"""
