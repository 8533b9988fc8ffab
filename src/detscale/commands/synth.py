"""Generate the built-in synthetic shapes dataset in the Ultralytics / YOLOv9 layout.

DIR/images/{train,val}/*.jpg, DIR/labels/{train,val}/*.txt and DIR/data.yaml (written last).
The same seed gives byte-identical files, whatever the number of worker processes.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output folder (created; a previous generation is replaced)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generator (default 0)")
    parser.add_argument("--imgsz", type=int, default=640, help="side of the square images in pixels (default 640)")
    parser.add_argument("--train", type=int, default=400, help="number of training images (default 400)")
    parser.add_argument("--val", type=int, default=100, help="number of validation images (default 100)")
    parser.add_argument("--objects", type=int, nargs=2, default=(1, 10), metavar=("MIN", "MAX"),
                        help="objects per image (default 1 10)")
    parser.add_argument("--object-size", type=float, nargs=2, default=(0.02, 0.6), metavar=("MIN", "MAX"),
                        help="object size as a fraction of the image side (default 0.02 0.6)")
    parser.add_argument("--workers", type=int, default=0, help="worker processes (default 0: every core)")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from detscale.data.synth import SynthParams, generate

    params = SynthParams(imgsz=args.imgsz, objects=tuple(args.objects), object_size=tuple(args.object_size))
    with tqdm(total=args.train + args.val, desc="synth", unit="img", disable=None) as bar:
        summary = generate(args.out, seed=args.seed, train=args.train, val=args.val, params=params,
                           workers=args.workers, progress=bar.update)
    per_class = ", ".join(f"{k} {v}" for k, v in summary["per_class"].items())
    print(
        f"synth: {summary['train']} train + {summary['val']} val images of {args.imgsz} px, "
        f"{summary['objects']} objects ({per_class}) in {summary['out']} "
        f"[{summary['seconds']:.1f} s, {summary['workers']} workers]"
    )
    return 0
