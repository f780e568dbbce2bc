"""bf16 ``grouped_gemm`` in the masked layout of decode (the absorbed MLA products): the 16 x 64 tile against the
64 x 128 tile, alternated twice in one run (one CUDA GPU).

    python3 benchmarks/grouped_mla_tiles.py

128 heads, each holding every one of T rows (T = 1 ... 256): ``w_uk`` (N=512, K=128) and ``w_uv`` (N=128, K=512).
Device time in us from CUDA graphs, median of 100 replays.
"""

import torch

from deepinfer.bench import time_graph_ms
from deepinfer_cuda_sm100 import gemm


def main() -> None:
    for n, k in ((512, 128), (128, 512)):
        for t in (1, 8, 16, 32, 48, 64, 256):
            g = torch.Generator(device="cuda").manual_seed(t)
            sets = [
                {
                    "a": torch.randn(128, t, k, device="cuda", generator=g, dtype=torch.bfloat16),
                    "w": torch.randn(128, n, k, device="cuda", generator=g, dtype=torch.bfloat16) * k**-0.5,
                    "expert_offsets": None,
                    "masked_m": torch.full((128,), t, dtype=torch.int32, device="cuda"),
                    "out_dtype": torch.bfloat16,
                }
                for _ in range(2)
            ]
            res = {"16-row": [], "64x128": []}
            for side in ("16-row", "64x128", "16-row", "64x128"):
                gemm.DECODE_TILE_MAX_M = 1 << 30 if side == "16-row" else 0
                ms = time_graph_ms(lambda i, s=sets: gemm.grouped_gemm(**s[i]), sets=2, reps=100)
                res[side].append(round(ms * 1000, 1))
            print(f"N={n} K={k} T={t}: 16x64 {res['16-row']} us, 64x128 {res['64x128']} us", flush=True)


if __name__ == "__main__":
    main()
