"""The DreamBooth paper's scores (DINO, CLIP-I, CLIP-T, DIV, PRES): drawing and embedding on actor pools, the math, the report."""
