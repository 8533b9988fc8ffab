"""Model information: `detscale model info NAME --imgsz 640 --nc 80 [--json]`.

Prints the parameter count and GFLOPs of the training form (RepConvN unfused, BatchNorm separate,
auxiliary PGI branch included for the YOLOv9 models) and of the fused inference form. GFLOPs are
counted with torch.utils.flop_counter.FlopCounterMode as 2 x multiply-accumulates of convolutions
and matrix products for one image; BatchNorm, activations, pooling and conv biases are not counted.
With --json the output is {"train": {"params", "gflops"}, "fused": {"params", "gflops"}}.
"""

from __future__ import annotations

import argparse
import json

from detscale.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    info = sub.add_parser("info", help="parameters and GFLOPs of a model, training and fused form",
                          description=__doc__)
    info.add_argument("name", help="model name: gelan-t, gelan-s, gelan-m, gelan-c, yolov9-t, yolov9-s")
    info.add_argument("--imgsz", type=int, default=640, help="square input size in pixels (default 640)")
    info.add_argument("--nc", type=int, default=80, help="number of classes (default 80)")
    info.add_argument("--json", action="store_true", help="print the machine-readable JSON object only")


def run(args: argparse.Namespace) -> int:
    from detscale.model.info import model_info

    if args.imgsz < 32 or args.imgsz % 32:
        raise UserError(f"--imgsz must be a positive multiple of 32 (the largest stride), got {args.imgsz}")
    info = model_info(args.name, args.imgsz, args.nc)
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{args.name}  (nc={args.nc}, {args.imgsz}x{args.imgsz} input)")
    print(f"{'form':<8}{'params':>14}{'GFLOPs':>10}")
    for form in ("train", "fused"):
        print(f"{form:<8}{info[form]['params']:>14,}{info[form]['gflops']:>10.2f}")
    print("GFLOPs = 2 x multiply-accumulates of convs/matmuls (torch FlopCounterMode); "
          "BatchNorm and activations not counted.")
    return 0
