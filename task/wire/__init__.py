"""What the server and the hospitals exchange: the requests the server sends (``requests``), the Flower wire
format both apps share (``flower_wire``) and the library primitives of the secure sum (``secagg``).

Import a module, not this package: ``from task.wire.requests import TeacherTrainingRequest``."""
