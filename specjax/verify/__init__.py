"""What one verification pass reads and decides: warping and sampling (`sampling`), tree
shapes (`trees`), the layout both kinds of tree build (`layout`) and the exact acceptance
rules (`acceptance`)."""
