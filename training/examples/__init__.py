"""Small distributed programs of the kind `invoke run` launches, tested on one process and on two ranks."""
