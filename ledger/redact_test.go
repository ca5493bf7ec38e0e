package ledger

import (
	"fmt"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestRedact(t *testing.T) {
	t.Parallel()
	const doc = `{"order_id":"ord_1","reason":"card 4242","card":{"number":"4242","exp":"12/30"},
		"items":[{"note":"a","sku":"x"},{"note":"b","sku":"y"}],"a/b":1,"m~n":2,"0":3}`
	tests := []struct {
		name     string
		pointers []string
		want     string
	}{
		{name: "none", pointers: nil, want: doc},
		{name: "top-level pointer", pointers: []string{"/reason"},
			want: `{"order_id":"ord_1","reason":"[redacted]","card":{"number":"4242","exp":"12/30"},
				"items":[{"note":"a","sku":"x"},{"note":"b","sku":"y"}],"a/b":1,"m~n":2,"0":3}`},
		{name: "nested pointer", pointers: []string{"/card/number"},
			want: `{"order_id":"ord_1","reason":"card 4242","card":{"number":"[redacted]","exp":"12/30"},
				"items":[{"note":"a","sku":"x"},{"note":"b","sku":"y"}],"a/b":1,"m~n":2,"0":3}`},
		{name: "whole object", pointers: []string{"/card"},
			want: `{"order_id":"ord_1","reason":"card 4242","card":"[redacted]",
				"items":[{"note":"a","sku":"x"},{"note":"b","sku":"y"}],"a/b":1,"m~n":2,"0":3}`},
		{name: "array index", pointers: []string{"/items/1/note"},
			want: `{"order_id":"ord_1","reason":"card 4242","card":{"number":"4242","exp":"12/30"},
				"items":[{"note":"a","sku":"x"},{"note":"[redacted]","sku":"y"}],"a/b":1,"m~n":2,"0":3}`},
		{name: "bare name at any depth", pointers: []string{"note", "number"},
			want: `{"order_id":"ord_1","reason":"card 4242","card":{"number":"[redacted]","exp":"12/30"},
				"items":[{"note":"[redacted]","sku":"x"},{"note":"[redacted]","sku":"y"}],"a/b":1,"m~n":2,"0":3}`},
		{name: "escaped tokens", pointers: []string{"/a~1b", "/m~0n"},
			want: `{"order_id":"ord_1","reason":"card 4242","card":{"number":"4242","exp":"12/30"},
				"items":[{"note":"a","sku":"x"},{"note":"b","sku":"y"}],"a/b":"[redacted]","m~n":"[redacted]","0":3}`},
		{name: "numeric key in object", pointers: []string{"/0"},
			want: `{"order_id":"ord_1","reason":"card 4242","card":{"number":"4242","exp":"12/30"},
				"items":[{"note":"a","sku":"x"},{"note":"b","sku":"y"}],"a/b":1,"m~n":2,"0":"[redacted]"}`},
		{name: "missing and malformed ignored", pointers: []string{"/nope", "/card/number/deeper", "/items/9/note", "/items/01/note", "/items/-", "/bad~2", "/reason/x"}, want: doc},
		{name: "root", pointers: []string{""}, want: `"[redacted]"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			in := mustDecode(t, doc)
			got := Redact(in, tc.pointers)
			if diff := cmp.Diff(mustDecode(t, tc.want), got); diff != "" {
				t.Errorf("Redact(%q) mismatch (-want +got):\n%s", tc.pointers, diff)
			}
			if diff := cmp.Diff(mustDecode(t, doc), in); diff != "" {
				t.Errorf("Redact(%q) modified its input (-want +got):\n%s", tc.pointers, diff)
			}
		})
	}
}

// TestRedactCopies: changing the copy must not change the original.
func TestRedactCopies(t *testing.T) {
	t.Parallel()
	in := mustDecode(t, `{"a":{"b":[1,{"c":2}]}}`)
	out := Redact(in, nil).(map[string]any)
	out["a"].(map[string]any)["b"].([]any)[1].(map[string]any)["c"] = "changed"
	if diff := cmp.Diff(mustDecode(t, `{"a":{"b":[1,{"c":2}]}}`), in); diff != "" {
		t.Errorf("modifying Redact's result changed its input (-want +got):\n%s", diff)
	}
}

func mustDecode(t *testing.T, s string) any {
	t.Helper()
	v, err := Decode([]byte(s), Limits{})
	if err != nil {
		t.Fatalf("Decode(%q) = %v", s, err)
	}
	return v
}

func TestLookup(t *testing.T) {
	tree, err := Decode([]byte(`{"a":{"b/c":{"d~e":1}},"order_id":"ord_1","list":[1]}`), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		ptr  string
		want string
		ok   bool
	}{
		{"/order_id", "ord_1", true},
		{"/a/b~1c/d~0e", "1", true},
		{"/missing", "", false},
		{"/list/0", "", false},
		{"order_id", "", false},
	} {
		v, ok := Lookup(tree, tc.ptr)
		if ok != tc.ok || (ok && fmt.Sprint(v) != tc.want) {
			t.Errorf("Lookup(%q) = %v, %v; want %q, %v", tc.ptr, v, ok, tc.want, tc.ok)
		}
	}
}
