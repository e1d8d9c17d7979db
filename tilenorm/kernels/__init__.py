"""Device code only: the kernel functions, nothing that launches them.

    cutile_row_norm.py          RMSNorm and LayerNorm forward and backward (cuTile): one
                                template, features as compile-time constants
    cutile_row_norm_fp8.py      the same norms with FP8 output (per-tensor, row, 1 x 128 and
                                MX block scales), FP8 input and the FP8-input backward
    cutile_column_sums.py       the fixed-order reduction of the backward's partial buffer
    cute_row_norm_backward.py   a row-norm backward in the CuTe DSL, loads in flight across rows

What is validated on a GPU is this folder and the settings (tilenorm/settings.py, settings_fp8.py):
tilenorm.validation pins their digest. tilenorm.launch binds plans to these kernels.
"""
