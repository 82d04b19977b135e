"""A user's image models and data, imported by the scripts under test through
`--model=user_applications:<function>` and `--dataset=user_applications:<function>`
(tests put this folder on PYTHONPATH, as a user's project would be).

Small `keras.applications` models (no pretrained weights) with a 10-class head, and a
tiny ConvNeXt-style network whose grouped convolution Keras runs on CPU as an
XLA-compiled function: the layer TensorFlow cannot run eagerly on another worker's device.
Every model is seeded, so each run starts from the same weights.
"""

import keras
import numpy as np

NUM_CLASSES = 10


def _classifier(backbone: keras.Model, input_shape: tuple) -> keras.Model:
    inputs = keras.Input(input_shape)
    head = keras.layers.Dense(NUM_CLASSES, kernel_initializer=keras.initializers.GlorotUniform(9))
    return keras.Model(inputs, head(backbone(inputs)))


def _application(name: str, input_shape: tuple = (32, 32, 3)) -> keras.Model:
    keras.utils.set_random_seed(0)
    backbone = getattr(keras.applications, name)(
        include_top=False, weights=None, input_shape=input_shape, pooling="avg"
    )
    return _classifier(backbone, input_shape)


def convnext_tiny():
    return _application("ConvNeXtTiny")


def efficientnet_v2_b0():
    return _application("EfficientNetV2B0")


def mobilenet_v3_small():
    return _application("MobileNetV3Small")


def resnet50_v2():
    return _application("ResNet50V2")


def densenet121():
    return _application("DenseNet121")


def xception():
    return _application("Xception", (71, 71, 3))


def grouped_convnet():
    """Three ConvNeXt-style blocks: a grouped 3x3 convolution (4 groups), LayerNorm, a
    pointwise MLP and a residual sum."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(16, 4, strides=4, name="stem")(inputs)
    for index in range(3):
        shortcut = x
        x = keras.layers.Conv2D(16, 3, padding="same", groups=4, name=f"grouped_{index}")(x)
        x = keras.layers.LayerNormalization(name=f"norm_{index}")(x)
        x = keras.layers.Dense(32, activation="gelu", name=f"expand_{index}")(x)
        x = keras.layers.Dense(16, name=f"project_{index}")(x)
        x = keras.layers.Add(name=f"residual_{index}")([shortcut, x])
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(NUM_CLASSES, name="head")(x))


def _images(side: int, count: int = 400):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(count, side, side, 3)).astype("float32")
    return x, rng.integers(0, NUM_CLASSES, size=count).astype("int64")


def images_16():
    return _images(16)


def images_32():
    return _images(32)


def images_71():
    return _images(71, count=200)
