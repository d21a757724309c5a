"""tools/triton_aot.py's reading of TTGIR text (no Triton needed): a reduction's digest follows the
definitions its operands name where they stand. Two sibling regions (a norm's two passes over a row
wider than one block: norm_kernel WIDE, the product kernel's tail) may give their values the same
names; a digest that took the last definition in the text would describe the second loop's operations
under the first loop's reduction, and two kernels with the same reduction would differ."""

from __future__ import annotations

from tools import triton_aot

LAYOUT = "#blocked = #ttg.blocked<{sizePerThread = [8], threadsPerWarp = [32], warpsPerCTA = [4], order = [0]}>"

# pass 1: s = round(h + y) into bf16, Σ s²; pass 2 reuses the names %h_3, %y_4, %s_5, %s_6 for other operations
TWO_PASSES = f"""{LAYOUT}
module {{
  tt.func public @k(%p: !tt.ptr<bf16>) {{
    %cst = arith.constant dense<0.000000e+00> : tensor<2048xf32, #blocked> loc(#loc1)
    %t = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %z) -> (f32) : i32 {{
      %h_1 = tt.load %ph : tensor<2048x!tt.ptr<bf16>, #blocked> loc(#loc2)
      %y_2 = tt.load %py : tensor<2048x!tt.ptr<bf16>, #blocked> loc(#loc3)
      %h_3 = arith.extf %h_1 : tensor<2048xbf16, #blocked> to tensor<2048xf32, #blocked> loc(#loc4)
      %y_4 = arith.extf %y_2 : tensor<2048xbf16, #blocked> to tensor<2048xf32, #blocked> loc(#loc5)
      %s_5 = arith.addf %h_3, %y_4 : tensor<2048xf32, #blocked> loc(#loc6)
      %s_6 = arith.truncf %s_5 : tensor<2048xf32, #blocked> to tensor<2048xbf16, #blocked> loc(#loc7)
      %s_7 = arith.extf %s_6 : tensor<2048xbf16, #blocked> to tensor<2048xf32, #blocked> loc(#loc8)
      %q_8 = math.fma %s_7, %s_7, %cst : tensor<2048xf32, #blocked> loc(#loc9)
      %r_9 = "tt.reduce"(%q_8) <{{axis = 0 : i32}}> ({{
      ^bb0(%a: f32, %b: f32):
        %sum = arith.addf %a, %b : f32 loc(#loc10)
        tt.reduce.return %sum : f32 loc(#loc10)
      }}) : (tensor<2048xf32, #blocked>) -> f32 loc(#loc11)
      scf.yield %r_9 : f32 loc(#loc12)
    }} loc(#loc13)
    scf.for %j = %c0 to %n step %c1 : i32 {{
      %h_1 = tt.load %ph : tensor<2048x!tt.ptr<bf16>, #blocked> loc(#loc14)
      %y_2 = tt.load %py : tensor<2048x!tt.ptr<bf16>, #blocked> loc(#loc15)
      %h_3 = arith.extf %h_1 : tensor<2048xbf16, #blocked> to tensor<2048xf32, #blocked> loc(#loc16)
      %y_4 = arith.mulf %h_3, %h_3 : tensor<2048xf32, #blocked> loc(#loc17)
      %s_5 = arith.subf %y_4, %h_3 : tensor<2048xf32, #blocked> loc(#loc18)
      %s_6 = arith.mulf %s_5, %s_5 : tensor<2048xf32, #blocked> loc(#loc19)
    }} loc(#loc20)
    tt.return loc(#loc21)
  }} loc(#loc22)
}} loc(#loc23)
"""

ONE_PASS = "\n".join(line for line in TWO_PASSES.splitlines()
                     if not line.strip().startswith(("scf.for %j", "%y_4 = arith.mulf", "%s_5 = arith.subf",
                                                     "%s_6 = arith.mulf"))
                     and "loc(#loc14)" not in line and "loc(#loc15)" not in line and "loc(#loc16)" not in line
                     and "loc(#loc20)" not in line)


def test_a_reduction_reads_the_definitions_above_it_in_its_own_region():
    defs, reduces = triton_aot.parse_ops(TWO_PASSES)
    (reduce,) = reduces
    form = triton_aot.reduce_form(reduce, defs).splitlines()
    assert form == ["arith.extf:f32", "arith.extf:f32", "arith.addf:f32", "arith.truncf:bf16", "arith.extf:f32",
                    "arith.constant:f32[dense<0.000000e+00>]", "math.fma:f32", form[-1]], form
    assert form[-1].startswith("tt.reduce:f32[axis=0") and "sizePerThread = [8]" in form[-1]
    # the second loop's operations under the same names change nothing: the digest is the one pass's
    assert triton_aot.reduce_summary(TWO_PASSES) == triton_aot.reduce_summary(ONE_PASS)
