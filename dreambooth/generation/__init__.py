"""Drawing images on a Ray Data actor pool, the prompts, image math and image files."""
