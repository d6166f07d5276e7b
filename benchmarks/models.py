"""The models the sections train, built by hand (no torchvision), and their training workloads."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .core import Config

__all__ = ["GPT", "SmallCNN", "Workload", "autoencoder", "mlp", "resnet18", "workloads"]


def mlp(inputs: int, width: int, outputs: int, depth: int = 2) -> nn.Sequential:
    """``depth`` hidden ``Linear`` + ``ReLU`` layers of ``width``, then a ``Linear`` head."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(inputs if i == 0 else width, width), nn.ReLU()]
    layers.append(nn.Linear(width, outputs))
    return nn.Sequential(*layers)


def autoencoder(widths: tuple[int, ...]) -> nn.Sequential:
    """``Linear`` layers through ``widths`` (input, ..., code, ..., output) with ``Tanh`` between them.

    The output layer is linear: its values are logits of the reconstructed pixels.
    """
    layers: list[nn.Module] = []
    for i, (inputs, outputs) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(inputs, outputs))
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """Two ``Conv2d`` + ``ReLU`` + max-pool stages, then a two-layer ``Linear`` head."""

    def __init__(self, in_channels: int, image: int, channels: tuple[int, int], hidden: int, classes: int = 10) -> None:
        super().__init__()
        first, second = channels
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, first, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(first, second, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(second * (image // 4) ** 2, hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class _Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4x-wide GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.expand = nn.Linear(width, 4 * width)
        self.contract = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.contract(F.gelu(self.expand(self.mlp_norm(x))))


class GPT(nn.Module):
    """A small GPT-style language model: token and position embeddings, blocks, a linear head."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[_Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        # Position ids batched like the tokens (B, T), as Hugging Face models take them: a per-sample
        # rule (DP) needs every input of a layer to carry the batch dimension.
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.head(self.norm(self.blocks(self.tokens(tokens) + self.positions(positions))))


class _BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.downsample = (
            nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))
            if stride != 1 or inputs != outputs
            else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.downsample(x))


def resnet18(classes: int = 1000, width: int = 64) -> nn.Sequential:
    """ResNet-18 (He et al. 2016); at ``width=64`` it has torchvision's parameter shapes (11,689,512 parameters)."""
    stages: list[nn.Module] = []
    channels = width
    for outputs, stride in ((width, 1), (2 * width, 2), (4 * width, 2), (8 * width, 2)):
        stages += [_BasicBlock(channels, outputs, stride), _BasicBlock(outputs, outputs, 1)]
        channels = outputs
    return nn.Sequential(
        nn.Conv2d(3, width, 7, 2, 3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        *stages,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, classes),
    )


@dataclass(frozen=True)
class Workload:
    """A model with one fixed batch and its loss: what a training step runs.

    Attributes:
        name: Short name for tables.
        description: The architecture and batch, for the report.
        build: A fresh model (seed the generator before calling for identical copies).
        batch: The inputs and targets of every step.
        loss: The loss of a model on the batch.
    """

    name: str
    description: str
    build: Callable[[], nn.Module]
    batch: tuple[Tensor, Tensor]
    loss: Callable[[nn.Module, tuple[Tensor, Tensor]], Tensor]


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, workload: Workload) -> Callable[[], None]:
    """One full training step of ``workload`` (zero_grad, forward, backward, step), as a call to time."""

    def step() -> None:
        optimizer.zero_grad()
        workload.loss(model, workload.batch).backward()
        optimizer.step()

    return step


def _classification_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _language_model_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def workloads(config: Config) -> list[Workload]:
    """The MLP, small CNN and small GPT of sections 2 and 3, sized for the run."""
    generator = torch.Generator().manual_seed(config.seed)
    batch = config.pick(8, 64, 256)
    mlp_width = config.pick(64, 512, 1024)
    cnn_batch, cnn_image = config.pick(4, 32, 64), config.pick(16, 32, 32)
    gpt_batch, context, width = config.pick(2, 8, 16), config.pick(16, 64, 64), config.pick(32, 128, 128)
    vocab = 512
    tokens = torch.randint(0, vocab, (gpt_batch, context + 1), generator=generator)
    return [
        Workload(
            "MLP",
            f"MLP 256-{mlp_width}-{mlp_width}-10 (ReLU), batch {batch}",
            lambda: mlp(256, mlp_width, 10),
            (torch.randn(batch, 256, generator=generator), torch.randint(0, 10, (batch,), generator=generator)),
            _classification_loss,
        ),
        Workload(
            "CNN",
            f"CNN conv3-32, conv3-64 (ReLU, max-pool), Linear-128-10; {cnn_image}x{cnn_image} RGB, batch {cnn_batch}",
            lambda: SmallCNN(3, cnn_image, (32, 64), 128),
            (
                torch.randn(cnn_batch, 3, cnn_image, cnn_image, generator=generator),
                torch.randint(0, 10, (cnn_batch,), generator=generator),
            ),
            _classification_loss,
        ),
        Workload(
            "GPT",
            f"GPT 4 layers, 4 heads, width {width}, context {context}, vocabulary {vocab}, batch {gpt_batch}",
            lambda: GPT(vocab, context, width, layers=4, heads=4),
            (tokens[:, :-1], tokens[:, 1:]),
            _language_model_loss,
        ),
    ]
