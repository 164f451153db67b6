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
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200 NVL", "h200-nvl"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA GH200 144G HBM3e", "gh200-144g"),
    ("NVIDIA H800", "h800"),
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
    # The NVL cards are PCIe cards with more memory, at lower clocks than the SXM parts.
    nvl, h200_nvl = catalog.gpu("NVIDIA H100 NVL"), catalog.gpu("NVIDIA H200 NVL")
    assert sxm.bf16_tflops > nvl.bf16_tflops > pcie.bf16_tflops
    assert nvl.memory_usable_gib > sxm.memory_usable_gib
    assert h200_nvl.bf16_tflops < catalog.gpu("NVIDIA H200").bf16_tflops
    # H800: H100 SXM's compute behind a narrower NVLink
    h800 = catalog.gpu("NVIDIA H800")
    assert h800.bf16_tflops == sxm.bf16_tflops
    assert catalog.link(h800.intra_node).gbps < catalog.link(sxm.intra_node).gbps
    with pytest.raises(FieldError, match="unknown GPU 'NVIDIA H100 SXM5 96GB'.*known: .*h100"):
        catalog.gpu("NVIDIA H100 SXM5 96GB")  # a name no row claims is not guessed from 'H100'


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
    assert metrics.detect_peak_flops(torch.device("cpu"), "bf16") is None


@pytest.mark.parametrize(
    ("name", "key"), [("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA GH200 480GB", "gh200"),
                      ("NVIDIA H800", "h800"), ("NVIDIA H200 NVL", "h200-nvl")],
)  # fmt: skip
def test_mfu_has_a_peak_on_the_cards_torch_names(monkeypatch, name, key):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    gpu = default_catalog().gpus[key]
    assert metrics.detect_peak_flops(torch.device("cuda"), "bf16") == gpu.bf16_tflops * 1e12


def test_an_unknown_card_is_named_in_a_warning_not_dropped_silently(monkeypatch, caplog):
    """MFU is left out on a card the catalog misses, and the log says which card and which
    setting gives it back."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU X1")
    with caplog.at_level("WARNING", logger=metrics.log.name):
        assert metrics.detect_peak_flops(cuda, "bf16") is None
    [record] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "'Mystery GPU X1'" in record.getMessage()
    assert "metrics.peak_tflops" in record.getMessage()
    # a known card without a rate for the precision (V100 has no bf16): the same, no crash
    caplog.clear()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    with caplog.at_level("WARNING", logger=metrics.log.name):
        assert metrics.detect_peak_flops(cuda, "bf16") is None
        assert metrics.detect_peak_flops(cuda, "fp16") == 125e12
    [record] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "bf16" in record.getMessage() and "metrics.peak_tflops" in record.getMessage()


def test_plan_cli_accepts_a_driver_name(capsys):
    argv = ["plan", "--model", "tiny-clip", "--gpu", "NVIDIA H100 80GB HBM3", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["gpu"]["key"] == "h100"
    assert main(["plan", "--model", "tiny-clip", "--gpu", "NVIDIA H100 SXM5 96GB"]) == 2
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
