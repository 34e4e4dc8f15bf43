"""What a run is asked to do, resolved once: the presets (``presets``), the methods and the one registry type
behind every extension point (``methods``, ``registry``), and the run's validated settings (``runconfig``).

Import a module, not this package: ``from task.settings.presets import get_preset``."""
