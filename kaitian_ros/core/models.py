"""Reference CNNs defined in-project (torchvision does not import beside our torch wheel).

The conv trunks follow the standard architectures (ResNet-18, MobileNetV2, VGG-11 config "A");
every head starts with an adaptive average pool so any input size >= 32 works. VGG-11's head is
pool(1) -> 512 -> classes instead of pool(7) -> 4096 -> 4096: the 120 M-parameter classifier adds
nothing to collaborative inference (it runs on the coordinator) but costs seconds to build.

Random weights come from a fixed seed. BatchNorm running statistics are calibrated on one seeded
random batch and then perturbed, so BN is a non-trivial affine map (mean != 0, var != 1) while
activations stay O(1) through the depth of the net - an exactness test on exploding or dead
activations would prove little.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping

import torch
from torch import nn

MODEL_NAMES: tuple[str, ...] = ("resnet18", "mobilenet_v2", "vgg11", "digits_cnn")

# Default (C, H, W) of each reference model, for callers that need a sensible input size.
DEFAULT_INPUT_SHAPES: dict[str, tuple[int, int, int]] = {
    "resnet18": (3, 224, 224),
    "mobilenet_v2": (3, 224, 224),
    "vgg11": (3, 224, 224),
    "digits_cnn": (1, 8, 8),
}


# --------------------------------------------------------------------------- ResNet-18
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 1000, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = (64, 128, 256, 512)
        layers: list[nn.Module] = []
        cin = 64
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w, 1)))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# --------------------------------------------------------------------------- MobileNetV2
def _conv_bn_relu6(cin: int, cout: int, k: int, stride: int, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(_conv_bn_relu6(cin, hidden, 1, 1))
        layers += [
            _conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, 1, 0, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    # (expand t, channels c, repeats n, stride s) - Sandler et al. 2018, table 2
    CFG = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
           (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))

    def __init__(self, num_classes: int = 1000, in_channels: int = 3) -> None:
        super().__init__()
        feats: list[nn.Module] = [_conv_bn_relu6(in_channels, 32, 3, 2)]
        cin = 32
        for t, c, n, s in self.CFG:
            for i in range(n):
                feats.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        feats.append(_conv_bn_relu6(cin, 1280, 1, 1))
        self.features = nn.Sequential(*feats)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


# --------------------------------------------------------------------------- VGG-11
class VGG11(nn.Module):
    CFG = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")

    def __init__(self, num_classes: int = 1000, in_channels: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = in_channels
        for v in self.CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, int(v), 3, padding=1), nn.ReLU(inplace=True)]
                cin = int(v)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(512, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# --------------------------------------------------------------------------- digits CNN
class DigitsCNN(nn.Module):
    """Small CNN for scikit-learn's 8x8 digits; no BatchNorm (training exactness relies on it).

    The adaptive pool to 4x4 is the identity on 8x8 inputs (after one 2x2 max-pool) and lets
    the same net run on any input size (e.g. 3x64x64 camera frames in inference tests).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.head_pool = nn.AdaptiveAvgPool2d(4)
        self.fc1 = nn.Linear(32 * 16, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(self.head_pool(x), 1)
        return self.fc2(torch.relu(self.fc1(x)))


_BUILDERS: dict[str, tuple[Callable[..., nn.Module], int, int]] = {
    # name -> (class, default num_classes, default in_channels)
    "resnet18": (ResNet18, 1000, 3),
    "mobilenet_v2": (MobileNetV2, 1000, 3),
    "vgg11": (VGG11, 1000, 3),
    "digits_cnn": (DigitsCNN, 10, 1),
}


def _init_weights(model: nn.Module) -> None:
    # Kaiming (fan_out) keeps activations O(1) through deep plain nets like VGG.
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.normal_(m.bias, 0.0, 0.05)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, (1.0 / m.in_features) ** 0.5)
            nn.init.normal_(m.bias, 0.0, 0.05)


@torch.no_grad()
def _randomise_bn(model: nn.Module, in_channels: int, gen: torch.Generator) -> None:
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    # Calibrate running stats on one seeded random batch (momentum None = cumulative average,
    # one step = the batch stats), so they roughly match real activations...
    saved = [bn.momentum for bn in bns]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    model.train()
    model(torch.randn(2, in_channels, 64, 64, generator=gen))
    for bn, mom in zip(bns, saved):
        bn.momentum = mom
        # ...then perturb everything so BN is a non-trivial, non-identity affine map.
        c = bn.num_features
        assert bn.running_mean is not None and bn.running_var is not None  # zoo BNs track stats
        bn.running_mean.add_(0.1 * torch.randn(c, generator=gen))
        bn.running_var.mul_(torch.empty(c).uniform_(0.7, 1.3, generator=gen))
        if bn.affine:
            bn.weight.copy_(torch.empty(c).uniform_(0.6, 1.4, generator=gen))
            bn.bias.copy_(0.1 * torch.randn(c, generator=gen))


def _import_callable(path: str) -> Callable[..., nn.Module]:
    mod_name, _, attr = path.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"model import path must be 'package.module:callable', got {path!r}")
    try:
        obj: object = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {mod_name!r} for model {path!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path!r} is not callable")
    return obj


def build_model(
    name: str,
    *,
    num_classes: int | None = None,
    in_channels: int | None = None,
    seed: int = 0,
    state_dict_path: str | None = None,
) -> nn.Module:
    """Build a model in eval() mode.

    `name` is one of MODEL_NAMES or a "package.module:callable" import path (the callable is
    called with whichever of num_classes / in_channels its signature accepts and must return an
    nn.Module). `in_channels` defaults to 3, except 1 for digits_cnn (8x8 grey digits).
    Weights are random from `seed` (deterministic) unless `state_dict_path` is given.
    """
    gen = torch.Generator().manual_seed(seed)
    if name in _BUILDERS:
        cls, nc_default, ic_default = _BUILDERS[name]
        ic = ic_default if in_channels is None else in_channels
        # Seed the global RNG too: module constructors draw default inits from it.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls(num_classes=nc_default if num_classes is None else num_classes,
                        in_channels=ic)
            _init_weights(model)
            _randomise_bn(model, ic, gen)
    elif ":" in name:
        fn = _import_callable(name)
        kwargs: dict[str, int] = {}
        params: Mapping[str, inspect.Parameter]
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        if num_classes is not None and "num_classes" in params:
            kwargs["num_classes"] = num_classes
        if in_channels is not None and "in_channels" in params:
            kwargs["in_channels"] = in_channels
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = fn(**kwargs)
        if not isinstance(model, nn.Module):
            raise ValueError(f"{name!r} returned {type(model).__name__}, not torch.nn.Module")
    else:
        raise ValueError(
            f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)} "
            "or a 'package.module:callable' import path"
        )
    if state_dict_path is not None:
        state = torch.load(state_dict_path, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    return model.eval()
