"""Real serving engines in the tests: a tiny model written here (``model``), llama.cpp's
``llama-server`` started on it (``llama_server``), and a recording relay that reads the engine's
answers independently of streamquake (``tap``)."""
