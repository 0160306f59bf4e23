"""A user's pipeline as `python -m shmloader.compare` meets it: torchvision's ImageFolder over
a folder of JPEGs with the usual training transforms, RandomResizedCrop(224),
RandomHorizontalFlip, ToTensor and Normalize, written here with Pillow and torch because
torchvision is not a dependency. The JPEGs are generated once (see jpeg_folder.py) into
a folder under the temp dir, and kept for the next run.

    python -m shmloader.compare --dataset benchmarks/imagefolder_example.py:make_dataset \\
        --batch-size 32 --num-workers 2 --shuffle --persistent-workers

The transforms draw from torch's global generator, as torchvision's do, and each
loader's workers seed it alike: compare checks the loaders' batches exactly. bench.py
runs the same dataset as its `imagefolder` preset.
"""

import tempfile
from pathlib import Path
from typing import Any, Callable

import jpeg_folder
import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

DEFAULT_ROOT = Path(tempfile.gettempdir()) / "shmloader-imagefolder-example"
MEAN = (0.485, 0.456, 0.406)  # ImageNet's, as every torchvision training script normalises
STD = (0.229, 0.224, 0.225)


class Compose:
    def __init__(self, transforms: list[Callable[[Any], Any]]):
        self.transforms = transforms

    def __call__(self, image: Any) -> Any:
        for transform in self.transforms:
            image = transform(image)
        return image


class RandomResizedCrop:
    """RandomResizedCrop(224) with torchvision's default scale and ratio."""

    def __call__(self, image: Image.Image) -> Image.Image:
        return jpeg_folder.random_resized_crop(image, None)


class RandomHorizontalFlip:
    def __call__(self, image: Image.Image) -> Image.Image:
        return (
            image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            if torch.rand(1).item() < 0.5
            else image
        )


class ToTensor:
    """HWC uint8 pixels to a CHW float32 tensor in [0, 1]."""

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous().float().div_(255)


class Normalize:
    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.sub_(self.mean).div_(self.std)


class ImageFolder(Dataset):
    """root/<class>/<image>.jpg; item i is (transform(image i), its class index), the
    classes and files in name order, as torchvision's ImageFolder lists them."""

    def __init__(self, root: Path, transform: Callable[[Image.Image], Any]):
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.samples = [
            (path, label)
            for label, name in enumerate(self.classes)
            for path in sorted((root / name).glob("*.jpg"))
        ]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, label = self.samples[index]
        with Image.open(path) as file:  # torchvision's pil_loader
            image = file.convert("RGB")
        return self.transform(image), label


def make_dataset(
    root: str = str(DEFAULT_ROOT), images_per_class: int = jpeg_folder.IMAGES_PER_CLASS
) -> ImageFolder:
    """The training set: images_per_class generated JPEGs in each of jpeg_folder.CLASSES
    classes, under root (generated on the first call)."""
    folder = jpeg_folder.ensure_tree(Path(root) / f"{images_per_class}-per-class", images_per_class)
    return ImageFolder(
        folder,
        Compose([RandomResizedCrop(), RandomHorizontalFlip(), ToTensor(), Normalize(MEAN, STD)]),
    )
