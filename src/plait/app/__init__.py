"""The `plait` command-line application: `plait train`, `plait run` and `plait bench`.

Built on the library (`plait`), never imported by it: the library holds every layout, this
package only turns flags and config files into one of them and runs the training loop.
"""
