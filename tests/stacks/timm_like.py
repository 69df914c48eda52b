"""Small image classifiers with the module names of timm's and torchvision's, built by hand.

timm itself needs torchvision, whose wheel for torch 2.13.0 does not import here (its
`torchvision::nms` registration fails), so these copy the *names* that matter to a
policy's globs, read from timm 1.0.31's source: where the classifier sits and what holds
parameters of its own. Each `build_*` takes no argument, so `hookpolicy explain --model
tests/stacks/timm_like.py:build_nf_regnet` works too. `CLASSIFIER` names each model's
final linear layer.

- `nf_regnet` (timm `nfnet.py`, `nf_regnet_b0`): `stem.conv`, `stages.N.M.{conv1,conv2,conv3}`
  with a `skipinit_gain` of the block's own, `final_conv`, and `head` a `ClassifierHead`
  (`global_pool`, `fc`, `flatten`; no parameter of its own).
- `convnext` (timm `convnext.py`): `stem.0` conv and `stem.1` norm, `stages.N.blocks.M`
  (`conv_dw`, `norm`, `mlp.fc1`, `mlp.fc2`, a `gamma` of the block's own) and `head` a
  `NormMlpClassifierHead` (`global_pool`, `norm`, `flatten`, `pre_logits`, `drop`, `fc`):
  its `norm` is not the classifier.
- `resnet` (timm and torchvision `resnet.py`): `conv1`, `bn1`, `layerN.M.{conv1,bn1,conv2,bn2}`, `fc`.
- `vit` (timm `vision_transformer.py`): `patch_embed.proj`, `blocks.N.{norm1,attn.qkv,...}`,
  `norm`, `head` (a Linear).
- `hf_classifier` (Hugging Face `...ForImageClassification`): `features...`, `classifier` (a Linear).
"""

from __future__ import annotations

import torch
from torch import nn

CLASSES = 5


class ClassifierHead(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(features, CLASSES)
        self.flatten = nn.Flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.global_pool(x).flatten(1))


class NormMlpClassifierHead(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.norm = nn.LayerNorm(features)
        self.flatten = nn.Flatten(1)
        self.pre_logits = nn.Identity()
        self.drop = nn.Dropout(0.0)
        self.fc = nn.Linear(features, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.pre_logits(self.norm(self.flatten(self.global_pool(x))))))


class NormFreeBlock(nn.Module):
    def __init__(self, chs: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(chs, chs, 1)
        self.conv2 = nn.Conv2d(chs, chs, 3, padding=1)
        self.conv3 = nn.Conv2d(chs, chs, 1)
        self.skipinit_gain = nn.Parameter(torch.full((), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv3(torch.relu(self.conv2(torch.relu(self.conv1(x)))))
        return x + self.skipinit_gain * h


class Stem(nn.Module):
    def __init__(self, chs: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, chs, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class NfRegNet(nn.Module):
    def __init__(self, chs: int = 8) -> None:
        super().__init__()
        self.stem = Stem(chs)
        self.stages = nn.Sequential(nn.Sequential(NormFreeBlock(chs), NormFreeBlock(chs)), nn.Sequential(NormFreeBlock(chs)))
        self.final_conv = nn.Conv2d(chs, 2 * chs, 1)
        self.head = ClassifierHead(2 * chs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.final_conv(self.stages(self.stem(x)))))


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, chs: int) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(chs, chs, 7, padding=3, groups=chs)
        self.norm = nn.LayerNorm(chs)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc1", nn.Linear(chs, 4 * chs))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("fc2", nn.Linear(4 * chs, chs))
        self.gamma = nn.Parameter(torch.full((chs,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp(self.norm(self.conv_dw(x).permute(0, 2, 3, 1))) * self.gamma
        return x + h.permute(0, 3, 1, 2)


class ConvNeXtStage(nn.Module):
    def __init__(self, chs: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[ConvNeXtBlock(chs) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class ConvNeXt(nn.Module):
    def __init__(self, chs: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, chs, 4, stride=4), LayerNorm2d(chs))
        self.stages = nn.Sequential(ConvNeXtStage(chs, 2), ConvNeXtStage(chs, 1))
        self.norm_pre = nn.Identity()
        self.head = NormMlpClassifierHead(chs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm_pre(self.stages(self.stem(x))))


class BasicBlock(nn.Module):
    def __init__(self, chs: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(chs, chs, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(chs)
        self.conv2 = nn.Conv2d(chs, chs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(chs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    def __init__(self, chs: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, chs, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(chs)
        self.layer1 = nn.Sequential(BasicBlock(chs))
        self.layer2 = nn.Sequential(BasicBlock(chs))
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(chs, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer2(self.layer1(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(self.global_pool(h).flatten(1))


class PatchEmbed(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, 4, stride=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(nn.functional.scaled_dot_product_attention(q, k, v))


class VitBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc1", nn.Linear(dim, 2 * dim))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("fc2", nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(dim)
        self.blocks = nn.Sequential(VitBlock(dim), VitBlock(dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.patch_embed(x))).mean(1))


class HfImageClassifier(nn.Module):
    def __init__(self, chs: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, chs, 3, stride=2, padding=1), nn.GELU(), nn.Conv2d(chs, chs, 3))
        self.classifier = nn.Linear(chs, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


def build_nf_regnet() -> nn.Module:
    return NfRegNet()


def build_convnext() -> nn.Module:
    return ConvNeXt()


def build_resnet() -> nn.Module:
    return ResNet()


def build_vit() -> nn.Module:
    return VisionTransformer()


def build_hf_classifier() -> nn.Module:
    return HfImageClassifier()


BUILDERS = {"nf_regnet": build_nf_regnet, "convnext": build_convnext, "resnet": build_resnet, "vit": build_vit,
            "hf_classifier": build_hf_classifier}
#: each model's final linear layer, the one AGC leaves alone
CLASSIFIER = {"nf_regnet": "head.fc", "convnext": "head.fc", "resnet": "fc", "vit": "head", "hf_classifier": "classifier"}
