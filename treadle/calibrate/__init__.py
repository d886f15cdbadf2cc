"""Calibrated post-training quantization: a float checkpoint in, a compressed-tensors
checkpoint out (``treadle quantize``).

    ModelSource (HF dir or GGUF, float weights)
        |  hf_model.build_hf_model        transformers' model class on those weights
        |  calibration.calibration_batch  token windows cut from a text file
        v
    pipeline.quantize_model: decoder layers one at a time, each fed the previous
        |   (already quantized) layer's outputs; forward hooks collect what a method needs
        |   rtn / smoothquant / gptq / awq  ->  fake-quantized float weights + scales
        v
    writer.write_checkpoint: compressed-tensors config + packed tensors + tokenizer files

Calibration runs on transformers' model rather than Treadle's paged model: the
compressed-tensors writer itself imports transformers and names modules the way
transformers does, the layers take plain [batch, seq, hidden] tensors (no KV cache or
attention metadata to build), and q/k/v and gate/up are separate modules as in the
checkpoint being written.
"""
