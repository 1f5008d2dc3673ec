"""The engine core in a process of its own (`kvrelay serve`), and the client the API process uses."""
