"""Ready-to-deploy flows built on prefect-nemo."""
