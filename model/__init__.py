"""The DeepSeek-V3 model family on deepinfer ops."""
