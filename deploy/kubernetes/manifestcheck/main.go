// Command manifestcheck decodes Kubernetes manifests (multi-document YAML on stdin) into the typed
// objects of k8s.io/api the way the API server does with strict field validation (kubectl's
// default): case-sensitive, so a misspelt or misplaced field, a duplicate key, a value of the wrong
// type or a malformed quantity is an error (exit 1). Kinds it does not
// know (e.g. the Prometheus Operator's) are listed as skipped on stderr. tests/unit/test_deploy.py
// feeds it deploy/kubernetes/*.yaml and the Helm chart's rendered output; `make tools` builds it.
package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

func typed(apiVersion, kind string) any {
	switch apiVersion + " " + kind {
	case "apps/v1 Deployment":
		return &appsv1.Deployment{}
	case "apps/v1 StatefulSet":
		return &appsv1.StatefulSet{}
	case "batch/v1 Job":
		return &batchv1.Job{}
	case "v1 Service":
		return &corev1.Service{}
	case "v1 ServiceAccount":
		return &corev1.ServiceAccount{}
	case "v1 Secret":
		return &corev1.Secret{}
	case "v1 ConfigMap":
		return &corev1.ConfigMap{}
	case "policy/v1 PodDisruptionBudget":
		return &policyv1.PodDisruptionBudget{}
	}
	return nil
}

func main() {
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	bad := 0
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			fmt.Printf("reading: %v\n", err)
			os.Exit(1)
		}
		var head struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Metadata   struct {
				Name string `json:"name"`
			} `json:"metadata"`
		}
		if err := yaml.Unmarshal(doc, &head); err != nil {
			fmt.Printf("not YAML: %v\n", err)
			bad++
			continue
		}
		if head.Kind == "" {
			continue // an empty document
		}
		object := typed(head.APIVersion, head.Kind)
		if object == nil {
			fmt.Fprintf(os.Stderr, "skipped %s %s/%s\n", head.APIVersion, head.Kind, head.Metadata.Name)
			continue
		}
		where := head.Kind + "/" + head.Metadata.Name
		data, err := yaml.YAMLToJSONStrict(doc)
		if err != nil {
			fmt.Printf("%s: %v\n", where, err)
			bad++
			continue
		}
		strict, err := json.UnmarshalStrict(
			data, object, json.DisallowUnknownFields, json.DisallowDuplicateFields)
		for _, problem := range append(strict, err) {
			if problem != nil {
				fmt.Printf("%s: %v\n", where, problem)
				bad++
			}
		}
	}
	if bad > 0 {
		os.Exit(1)
	}
}
