"""GPU names as torch prints them resolve to the right catalog row; fp32 on CUDA uses TF32."""

import json

import pytest
import torch

from mmtrain.cli import main
from mmtrain.hardware import default_catalog
from mmtrain.structured import FieldError
from mmtrain.train import metrics
from mmtrain.train.precision import make_precision

# `torch.cuda.get_device_name()` (the driver's product name) -> catalog key. The PCIe and SXM
# parts of one chip differ in clocks and links, so each must land on its own row.
DEVICE_NAMES = [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-SXM4-40GB", "a100-40g"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie-40g"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA B300 SXM6 AC", "b300"),
    ("NVIDIA B300", "b300"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA GeForce RTX 5090", "rtx5090"),
    ("NVIDIA RTX A6000", "rtx-a6000"),
]


@pytest.mark.parametrize(("name", "key"), DEVICE_NAMES)
def test_driver_names_resolve_to_their_row(name, key):
    catalog = default_catalog()
    assert catalog.gpu(name).key == key
    assert catalog.resolve_device(name) == (catalog.gpus[key], 1.0)


def test_pcie_and_sxm_stay_apart():
    catalog = default_catalog()
    sxm, pcie = catalog.gpu("NVIDIA H100 80GB HBM3"), catalog.gpu("NVIDIA H100 PCIe")
    assert sxm.bf16_tflops > pcie.bf16_tflops
    assert catalog.gpu("NVIDIA A100 80GB PCIe").mem_bw_tbps < catalog.gpu("a100").mem_bw_tbps
    with pytest.raises(FieldError, match="unknown GPU 'NVIDIA H100 NVL'.*known: .*h100-pcie"):
        catalog.gpu("NVIDIA H100 NVL")  # a third H100 (94 GB) the catalog does not hold


def test_mig_instance_gets_its_share_of_the_peak():
    gpu, share = default_catalog().resolve_device("NVIDIA A100-SXM4-40GB MIG 3g.20gb")
    assert (gpu.key, share) == ("a100-40g", 3 / 7)
    with pytest.raises(FieldError, match="MIG profile"):
        default_catalog().resolve_device("NVIDIA A100-SXM4-40GB MIG big")


def test_two_rows_claiming_one_name_is_an_error(tmp_path):
    path = tmp_path / "hw.yaml"
    path.write_text("gpus:\n  h100:\n    device_names: ['NVIDIA H100 PCIe']\n")
    with pytest.raises(
        FieldError, match="h100-pcie: name 'NVIDIA H100 PCIe' already names GPU 'h100'"
    ):
        default_catalog().extended(path)


def test_detect_peak_flops_uses_the_driver_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    cuda = torch.device("cuda")
    pcie = default_catalog().gpus["h100-pcie"]
    assert metrics.detect_peak_flops(cuda, "bf16") == pcie.bf16_tflops * 1e12
    assert metrics.detect_peak_flops(cuda, "fp32") == pcie.tf32_tflops * 1e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU")
    assert metrics.detect_peak_flops(cuda, "bf16") is None
    assert metrics.detect_peak_flops(torch.device("cpu"), "bf16") is None


def test_plan_cli_accepts_a_driver_name(capsys):
    argv = ["plan", "--model", "tiny-clip", "--gpu", "NVIDIA H100 80GB HBM3", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["gpu"]["key"] == "h100"
    assert main(["plan", "--model", "tiny-clip", "--gpu", "NVIDIA H100 NVL"]) == 2
    assert "known: " in capsys.readouterr().err


@pytest.fixture
def restore_tf32():
    matmul, conv = torch.get_float32_matmul_precision(), torch.backends.cudnn.conv.fp32_precision
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.conv.fp32_precision = conv


def test_fp32_on_cuda_uses_tf32_unless_switched_off(restore_tf32):
    # Setting the switches needs no GPU, so this holds on the CPU build too.
    cuda = torch.device("cuda")
    make_precision("fp32", cuda)
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    make_precision("fp32", cuda, tf32=False)
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"
    make_precision("fp32", torch.device("cpu"))  # CPU runs keep IEEE fp32 (bitwise tests)
    assert torch.get_float32_matmul_precision() == "highest"
