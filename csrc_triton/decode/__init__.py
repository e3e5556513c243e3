"""The DeepSeek-V4 sparse-MLA decode kernels, named by structure (installed as
``dsv4_ops.csrc_triton.decode``):

- ``tiles``          split-KV over a bf16 workspace, 16-head tiles x 16-key blocks (mode ``tiles``)
- ``heads``          all heads of a token in one program over the workspace (mode ``heads``)
- ``merge``          LSE merge of split partials with the attention sink
- ``paged_chunk128`` reads the 584-byte paged records directly, 4 x 128-dim chunks (configs ``h...``)
- ``paged_f16dot``   paged records, E4M3 codes fed to fp16 dots (configs ``kh...`` / ``gh...``)
- ``balance``        the balanced split's planning kernel (paged_f16dot, DSV4_AMPERE_DECODE_BALANCE=1)

Which one runs is decided in ``dsv4_ops.dispatch``.
"""
