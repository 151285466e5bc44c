"""The DeepSeek-V4.1 fix's reproductions on the installed vLLM, on CPU.

``failures`` reproduces the start-up and page failures and shows the fix
removes them (``verify``); ``capacity`` measures KV tokens per GiB of each
layout; ``truth_table`` derives every cell of the README's table.
"""
