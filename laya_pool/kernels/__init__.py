"""The Laya forward: architecture description and the plain-torch reference path.

Depends on nothing else in this project, so the worker, the generator and the harnesses can all
share one description of the model.
"""
