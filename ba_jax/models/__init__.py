"""Model definitions (Qwen2/2.5/3) and Hugging Face conversion; see qwen.py, hf_table.py and
convert_hf.py."""
