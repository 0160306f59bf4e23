"""The `jpeg` workload: an ImageFolder tree of JPEG files, decoded and augmented per sample.

The files are generated deterministically (smooth colour fields plus noise, so that they
compress like photographs rather than like flat colour) and the augmentation is torchvision's
RandomResizedCrop(224) + RandomHorizontalFlip + PILToTensor, rewritten here with Pillow
and torch because torchvision is not a dependency. Its random draws come from a
generator seeded with the sample's index, so every loader crops every sample alike and
their batches can be compared for equality.
"""

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

CLASSES = 10
IMAGES_PER_CLASS = 30
# (width, height) of the generated images, in turn: ImageNet's typical sizes.
SIZES = [(500, 375), (375, 500), (500, 333)]
QUALITY = 90
NOISE = 16  # amplitude of the uniform pixel noise
COLOUR_GRID = (6, 8)  # (rows, columns) of the random colours an image blends
SEED = 0
CROP = 224
SCALE = (0.08, 1.0)  # torchvision's RandomResizedCrop defaults
RATIO = (3 / 4, 4 / 3)


def ensure_tree(root: Path, images_per_class: int = IMAGES_PER_CLASS) -> Path:
    """root/class_XX/image_XXXX.jpg, written unless already there (the presets of a
    run share one tree)."""
    if root.is_dir():
        return root
    rng = np.random.default_rng(SEED)
    for label in range(CLASSES):
        folder = root / f"class_{label:02d}"
        folder.mkdir(parents=True)
        for i in range(images_per_class):
            width, height = SIZES[i % len(SIZES)]
            Image.fromarray(synthetic_photo(rng, width, height)).save(
                folder / f"image_{i:04d}.jpg", quality=QUALITY
            )
    return root


def synthetic_photo(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """An RGB uint8 image: a coarse grid of random colours blended smoothly over the
    image, plus pixel noise."""
    colours = rng.integers(0, 256, size=(*COLOUR_GRID, 3), dtype=np.uint8)
    smooth = Image.fromarray(colours).resize((width, height), Image.Resampling.BICUBIC)
    noise = rng.integers(-NOISE, NOISE + 1, size=(height, width, 3), dtype=np.int16)
    return np.clip(np.asarray(smooth, dtype=np.int16) + noise, 0, 255).astype(np.uint8)


class JpegFolderDataset(Dataset):
    """ImageFolder-like: item i is (augmented image of file i % files, its class index)."""

    def __init__(self, root: Path, length: int):
        # Sorted, as ImageFolder lists them: a class per folder, in name order.
        folders = sorted(p for p in root.iterdir() if p.is_dir())
        self.files = [
            (path, label)
            for label, folder in enumerate(folders)
            for path in sorted(folder.glob("*.jpg"))
        ]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[index % len(self.files)]
        generator = torch.Generator().manual_seed(index)
        with Image.open(path) as file:  # torchvision's pil_loader
            image = file.convert("RGB")
        image = random_resized_crop(image, generator)
        if torch.rand(1, generator=generator).item() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        # PILToTensor: a CHW view of the HWC pixels, not contiguous, as torchvision returns it.
        return torch.from_numpy(np.array(image)).permute(2, 0, 1), label


def random_resized_crop(image: Image.Image, generator: torch.Generator | None) -> Image.Image:
    left, top, width, height = crop_box(image.width, image.height, generator)
    # Pillow crops and resizes in one pass when given a box.
    return image.resize(
        (CROP, CROP), Image.Resampling.BILINEAR, box=(left, top, left + width, top + height)
    )


def crop_box(
    width: int, height: int, generator: torch.Generator | None
) -> tuple[int, int, int, int]:
    """(left, top, width, height): torchvision's RandomResizedCrop.get_params, drawing
    from `generator` (None: torch's global generator, as torchvision draws)."""
    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(*SCALE, generator=generator).item()
        aspect = math.exp(torch.empty(1).uniform_(*log_ratio, generator=generator).item())
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
            left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
            return left, top, w, h
    # Ten misses: the largest central crop within the allowed aspect ratios.
    if width / height < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif width / height > RATIO[1]:
        w, h = round(height * RATIO[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h
