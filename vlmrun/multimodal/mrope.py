"""M-RoPE position ids for a prompt (Qwen2.5-VL and Qwen3-VL, images and videos).

Text tokens advance one position per token on all three rows (t, h, w). An image whose merged
grid is (t, h, w) occupies t*h*w tokens; starting at the current position p its tokens get
t-row p + frame, h-row p + row, w-row p + col (raster order), and the next token starts at
p + max(h, w). `delta = max position + 1 - L`, so the generated token at index i >= L sits at
`i + delta` on every row. Items (images, videos) are matched to runs of `image_token_id` /
`video_token_id` in order, each consuming exactly its own t*h*w tokens (so two adjacent items still
split correctly).

A Qwen2.5-VL video's t-row is scaled: frame group k sits at p + floor(k * tokens_per_second *
second_per_grid_t), computed in float32 as transformers does (`time_intervals`). Qwen3-VL / Qwen3.5
videos arrive as one item of grid (1, h, w) per temporal group (their timestamps are text), so
they need no scaling. Which families use this, and with which video timing, is the family's call
(`vlmrun.multimodal.prompt_positions`, `Model.prompt_positions`); text-only families use 1-D positions.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def compute_mrope_positions(token_ids: Sequence[int], image_grid_thw: Sequence[Sequence[int]],
                            hf_config: Any, second_per_grid_ts: Sequence[float | None] | None = None
                            ) -> tuple[torch.Tensor, int]:
    """Positions [3, L] int64 and the rope delta for one prompt.

    image_grid_thw: one (t, h, w) patch grid per image or video item, in prompt order (before
    spatial merge). second_per_grid_ts: per item, a Qwen2.5-VL video's seconds per temporal group
    (None for the others); absent = no scaling.
    """
    vision_ids = {hf_config.image_token_id, getattr(hf_config, "video_token_id", hf_config.image_token_id)}
    merge = hf_config.vision_config.spatial_merge_size
    tokens_per_second = getattr(hf_config.vision_config, "tokens_per_second", 1)
    grids = [tuple(int(x) for x in g) for g in image_grid_thw]
    seconds = list(second_per_grid_ts) if second_per_grid_ts is not None else [None] * len(grids)
    length = len(token_ids)
    rows: list[torch.Tensor] = []  # [3, n] pieces
    pos = 0  # position of the next token
    i = 0
    next_image = 0
    while i < length:
        if token_ids[i] not in vision_ids:
            j = i
            while j < length and token_ids[j] not in vision_ids:
                j += 1
            rows.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        if next_image >= len(grids):
            raise ValueError(f"more image-token runs in the prompt than the {len(grids)} image grids given")
        t, gh, gw = grids[next_image]
        h, w = gh // merge, gw // merge
        n = t * h * w
        if i + n > length or any(tok != token_ids[i] for tok in token_ids[i:i + n]):
            raise ValueError(f"image {next_image} with grid {grids[next_image]} needs {n} consecutive image "
                             f"tokens at index {i}")
        frame_pos = torch.arange(t)
        if seconds[next_image] is not None:  # as transformers: float32 product, truncated
            interval = tokens_per_second * torch.tensor(seconds[next_image], dtype=torch.float32)
            frame_pos = (frame_pos * interval).long()
        tt = frame_pos.view(t, 1, 1).expand(t, h, w)
        hh = torch.arange(h).view(1, h, 1).expand(t, h, w)
        ww = torch.arange(w).view(1, 1, w).expand(t, h, w)
        rows.append(torch.stack([tt, hh, ww]).reshape(3, n) + pos)
        pos += max(h, w)
        i += n
        next_image += 1
    if next_image != len(grids):
        raise ValueError(f"{len(grids)} image grids given but the prompt has image tokens for {next_image}")
    if not rows:
        return torch.zeros(3, 0, dtype=torch.int64), 0
    positions = torch.cat(rows, dim=1).to(torch.int64)  # [3, L]
    delta = int(positions.max()) + 1 - length
    return positions, delta
