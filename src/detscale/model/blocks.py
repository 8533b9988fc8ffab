"""The building blocks of GELAN / YOLOv9 (see ``shared/docs/yolov9-architecture.md``).

Every block is made of :class:`Conv` (Conv2d without bias, BatchNorm, SiLU). Blocks that can be
simplified for inference implement ``fuse()``, which rewrites them in place into an equivalent
form with fewer layers (Conv+BN folded into one biased conv; RepConvN's two branches folded into
one 3x3 conv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# BatchNorm settings of the reference models: a smaller epsilon and a slower running average
# than PyTorch's defaults.
BN_EPS = 1e-3
BN_MOMENTUM = 0.03


def fold_bn(weight: torch.Tensor, bias: torch.Tensor | None, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias of a conv followed by ``bn`` (in eval mode) as one biased conv."""
    std = (bn.running_var + bn.eps).sqrt()
    scale = bn.weight / std
    fused_w = weight * scale.reshape(-1, 1, 1, 1)
    b = bias if bias is not None else torch.zeros_like(bn.running_mean)
    fused_b = (b - bn.running_mean) * scale + bn.bias
    return fused_w.detach(), fused_b.detach()


class Conv(nn.Module):
    """Conv2d (no bias, padding k//2) -> BatchNorm2d -> SiLU (or no activation)."""

    def __init__(self, c_in: int, c_out: int, k: int = 1, s: int = 1, g: int = 1, act: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, k, s, k // 2, groups=g, bias=False)
        self.bn: nn.Module = nn.BatchNorm2d(c_out, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.act: nn.Module = nn.SiLU(inplace=True) if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))

    def fuse(self) -> None:
        """Fold the BatchNorm into the conv (inference only: uses the running statistics)."""
        if isinstance(self.bn, nn.Identity):
            return
        w, b = fold_bn(self.conv.weight, self.conv.bias, self.bn)
        c = self.conv
        fused = nn.Conv2d(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding,
                          groups=c.groups, bias=True).to(w.device, w.dtype)
        fused.weight.data.copy_(w)
        fused.bias.data.copy_(b)
        self.conv, self.bn = fused, nn.Identity()


class AConv(nn.Module):
    """Downsample x2: average pool 2x2 stride 1, then Conv 3x3 stride 2."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.cv1 = Conv(c_in, c_out, 3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv1(F.avg_pool2d(x, 2, 1, 0, ceil_mode=False, count_include_pad=True))


class ADown(nn.Module):
    """Downsample x2 in two halves: a strided 3x3 conv and a max-pool followed by a 1x1 conv."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        half = c_out // 2
        self.cv1 = Conv(c_in // 2, half, 3, 2)
        self.cv2 = Conv(c_in // 2, half, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.avg_pool2d(x, 2, 1, 0, ceil_mode=False, count_include_pad=True)
        a, b = x.chunk(2, 1)
        return torch.cat((self.cv1(a), self.cv2(F.max_pool2d(b, 3, 2, 1))), 1)


class RepConvN(nn.Module):
    """SiLU(Conv3x3-BN(x) + Conv1x1-BN(x)); :meth:`fuse` turns it into one biased 3x3 conv."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = Conv(c_in, c_out, 3, act=False)
        self.conv2 = Conv(c_in, c_out, 1, act=False)
        self.act = nn.SiLU(inplace=True)
        self.fused: nn.Conv2d | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.act(self.fused(x))
        return self.act(self.conv1(x) + self.conv2(x))

    def fuse(self) -> None:
        """Re-parameterise: the 1x1 kernel padded to 3x3 (centre tap) added to the 3x3 kernel."""
        if self.fused is not None:
            return
        w3, b3 = fold_bn(self.conv1.conv.weight, None, self.conv1.bn)
        w1, b1 = fold_bn(self.conv2.conv.weight, None, self.conv2.bn)
        fused = nn.Conv2d(w3.shape[1], w3.shape[0], 3, 1, 1, bias=True).to(w3.device, w3.dtype)
        fused.weight.data.copy_(w3 + F.pad(w1, [1, 1, 1, 1]))
        fused.bias.data.copy_(b3 + b1)
        self.fused = fused
        del self.conv1, self.conv2


class RepNBottleneck(nn.Module):
    """RepConvN -> Conv 3x3, with a residual connection when input and output widths match."""

    def __init__(self, c_in: int, c_out: int, shortcut: bool = True) -> None:
        super().__init__()
        self.cv1 = RepConvN(c_in, c_out)
        self.cv2 = Conv(c_out, c_out, 3)
        self.add = shortcut and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class RepNCSP(nn.Module):
    """CSP block: a 1x1 conv followed by ``n`` RepNBottlenecks, beside a plain 1x1 conv; merged by 1x1."""

    def __init__(self, c_in: int, c_out: int, n: int = 1) -> None:
        super().__init__()
        hidden = c_out // 2
        self.cv1 = Conv(c_in, hidden, 1)
        self.cv2 = Conv(c_in, hidden, 1)
        self.cv3 = Conv(2 * hidden, c_out, 1)
        self.m = nn.Sequential(*(RepNBottleneck(hidden, hidden) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class _SplitChain(nn.Module):
    """The ELAN pattern: ``cv1`` split in halves, ``cv2`` on the second, ``cv3`` on that, concat all, ``cv4``."""

    cv1: nn.Module
    cv2: nn.Module
    cv3: nn.Module
    cv4: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(x).chunk(2, 1))
        y.append(self.cv2(y[-1]))
        y.append(self.cv3(y[-1]))
        return self.cv4(torch.cat(y, 1))


class ELAN1(_SplitChain):
    """The small ELAN block of the T and S models (plain 3x3 convs instead of RepNCSP)."""

    def __init__(self, c1: int, c2: int, c3: int, c4: int) -> None:
        super().__init__()
        self.cv1 = Conv(c1, c3, 1)
        self.cv2 = Conv(c3 // 2, c4, 3)
        self.cv3 = Conv(c4, c4, 3)
        self.cv4 = Conv(c3 + 2 * c4, c2, 1)



class RepNCSPELAN4(_SplitChain):
    """GELAN block: split a 1x1 conv in halves and chain two RepNCSP+Conv3x3 branches on the second."""

    def __init__(self, c1: int, c2: int, c3: int, c4: int, n: int = 1) -> None:
        super().__init__()
        self.cv1 = Conv(c1, c3, 1)
        self.cv2 = nn.Sequential(RepNCSP(c3 // 2, c4, n), Conv(c4, c4, 3))
        self.cv3 = nn.Sequential(RepNCSP(c4, c4, n), Conv(c4, c4, 3))
        self.cv4 = Conv(c3 + 2 * c4, c2, 1)


class SPPELAN(nn.Module):
    """Spatial pyramid pooling: a 1x1 conv, three chained 5x5 max-pools, concat of all four, 1x1 conv."""

    def __init__(self, c1: int, c2: int, c3: int) -> None:
        super().__init__()
        self.cv1 = Conv(c1, c3, 1)
        self.pool = nn.MaxPool2d(5, 1, 2)
        self.cv5 = Conv(4 * c3, c2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = [self.cv1(x)]
        for _ in range(3):
            y.append(self.pool(y[-1]))
        return self.cv5(torch.cat(y, 1))


class DFL(nn.Module):
    """Distribution focal loss integral: softmax over ``reg_max`` bins, expectation = distance.

    A fixed 1x1 conv with weights 0..reg_max-1 (a buffer, not a trained parameter).
    """

    def __init__(self, reg_max: int = 16) -> None:
        super().__init__()
        self.reg_max = reg_max
        self.register_buffer("bins", torch.arange(reg_max, dtype=torch.float32).view(1, reg_max, 1, 1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, 4*reg_max, A] logits -> [B, 4, A] distances in grid cells."""
        b, _, a = x.shape
        p = x.view(b, 4, self.reg_max, a).transpose(2, 1).softmax(1)  # [B, reg_max, 4, A]
        return F.conv2d(p, self.bins.to(p.dtype)).view(b, 4, a)
