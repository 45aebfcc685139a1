"""The launch configurations of bcg's varlen attention kernel (:mod:`bcg.ops.kernels.triton_attention`): query rows
and keys a program works on per step, warps, pipeline stages and whether key blocks seen in full skip the masks.
Plain Python (no Triton), so benchmarks and tests name configurations on any machine.
"""

from __future__ import annotations

__all__ = ["BlockConfig", "block_config"]


class BlockConfig:
    """One launch configuration: query rows and keys a program works on per step, warps and pipeline stages.

    The defaults (:func:`block_config`) are the fastest measured on an H200 (``benchmarks/attention_kernels.py
    --sweep`` times the alternatives).
    """

    def __init__(self, block_m: int, block_n: int, num_warps: int, num_stages: int, split_mask: bool = True) -> None:
        self.block_m, self.block_n, self.num_warps, self.num_stages = block_m, block_n, num_warps, num_stages
        self.split_mask = split_mask  # key blocks seen in full skip the masks (False: every block masked)

    def __repr__(self) -> str:
        return (f"BlockConfig(block_m={self.block_m}, block_n={self.block_n}, num_warps={self.num_warps}, "
                f"num_stages={self.num_stages}, split_mask={self.split_mask})")


# Query runs of more than SPLIT_FROM_QUERY rows take 64-row blocks and the split key loop; shorter ones (few blocks
# seen in full: the split's extra loops cost more than the masks they save) mask every block. The fastest measured
# on the H200 (round 13, benchmarks/attention_kernels.py --sweep, table in BENCHMARKS.md): 0.65-0.80x round 12's
# time from 256 tokens at head dim 64 and from 1024 at 128; 16-32-row blocks were slower at every length.
SHORT_QUERY = 64
SPLIT_FROM_QUERY = 512


def block_config(head_dim: int, max_seqlen_q: int) -> BlockConfig:
    """The launch configuration for ``head_dim`` (at most 256) and a query-length bound of ``max_seqlen_q``: the
    fastest measured on an H200 (see the table above this function's source).

    Example::

        block_config(64, 2048)    # BlockConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, split_mask=True)
    """
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} is above the 256 this kernel supports")
    if head_dim > 128:  # not measured with the split: the blocks before it, every key block masked
        if max_seqlen_q <= SHORT_QUERY:
            return BlockConfig(64, 32, 4, 2, split_mask=False)
        return BlockConfig(64, 64, 8, 2, split_mask=False)
    if max_seqlen_q > SPLIT_FROM_QUERY:
        return BlockConfig(64, 64, 4, 3)
    if head_dim > 64 and max_seqlen_q > SHORT_QUERY:
        return BlockConfig(128, 64, 8, 3, split_mask=False)
    return BlockConfig(64, 64, 4, 3, split_mask=False)
