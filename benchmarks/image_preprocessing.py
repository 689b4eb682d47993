"""Time what the server's media pool does per image on one CPU thread: decoding (pillow, as
`multimodal/media.decode_image` does it: header check, full load, RGB) and preprocessing with
transformers' PIL CLIP image processor at LLaVA-1.5's 336 px, for photo-like images (a
gradient with noise, so that they compress as photos do) as JPEG and PNG.

    python benchmarks/image_preprocessing.py [--sizes 448x448,1920x1080] [--repeat 20]
"""

from __future__ import annotations

import argparse
import io
import time

import numpy as np
from PIL import Image
from transformers import CLIPImageProcessorPil

from pagedserve.multimodal.media import decode_image


def photo(width: int, height: int, rng: np.random.Generator) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], -1)
    noisy = base + rng.normal(0, 12, (height, width, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def per_call(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="448x448,1920x1080")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    processor = CLIPImageProcessorPil(size={"shortest_edge": 336},
                                      crop_size={"height": 336, "width": 336})
    rng = np.random.default_rng(0)
    for size in args.sizes.split(","):
        width, height = (int(v) for v in size.split("x"))
        image = photo(width, height, rng)
        for fmt in ("JPEG", "PNG"):
            buf = io.BytesIO()
            image.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
            raw = buf.getvalue()
            decoded = decode_image(raw)
            decode_s = per_call(lambda raw=raw: decode_image(raw), args.repeat)
            process_s = per_call(lambda im=decoded: processor(images=[im], return_tensors="pt"),
                                 args.repeat)
            print(f"{width}x{height} {fmt} {len(raw) >> 10} KiB: decode {decode_s * 1e3:.1f} ms, "
                  f"CLIP-336 preprocess {process_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
