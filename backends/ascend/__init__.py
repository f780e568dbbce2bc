"""deepinfer's Huawei Ascend backend: torch_npu fused operators for Ascend 950."""
