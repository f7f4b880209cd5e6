"""The inspection-camera example: data set, model, frame sources, and the real-time loop.

    dataset      procedural surface-defect images (ok, scratch, spot, crack), deterministic by seed
    preprocess   any camera frame → the fixed (64, 64) float32 model input
    model        NumPy stem and head around the colibri runtime (the MoE part runs from a bundle)
    torch_model  the same network in torch, for training and for checking the bundle's predictions
    sources      frame sources: synthetic, image folder, video file, USB camera, GStreamer pipeline
    loop         bounded drop-oldest queue, pacing, pass/fail events, stats, clean shutdown
    images       PNG writing and frame annotation without OpenCV
"""
