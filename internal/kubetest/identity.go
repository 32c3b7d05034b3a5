package kubetest

import (
	"context"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// token returns the static token of user (Admin or one of Options.Users).
func (cp *ControlPlane) token(t testing.TB, user string) string {
	t.Helper()
	if user == Admin {
		return cp.pki.adminToken
	}
	tok, ok := cp.pki.userTokens[user]
	if !ok {
		t.Fatalf("kubetest: user %q is not in Options.Users (the token file is fixed when the API server starts)", user)
	}
	return tok
}

// RESTConfig is a client configuration for user (Admin or one of Options.Users)
// that trusts the API server's CA. It has no client-side rate limit: tests and
// benchmarks create objects as fast as the server takes them.
func (cp *ControlPlane) RESTConfig(t testing.TB, user string) *rest.Config {
	t.Helper()
	return cp.restConfigForToken(cp.token(t, user))
}

func (cp *ControlPlane) restConfigForToken(token string) *rest.Config {
	return &rest.Config{
		Host:            cp.Host(),
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: cp.pki.caPEM},
		QPS:             -1,
		Timeout:         30 * time.Second,
		Dial:            cp.opts.Dial,
	}
}

// Kubeconfig writes a kubeconfig file for user (Admin or one of Options.Users) into
// the test's temporary directory and returns its path.
func (cp *ControlPlane) Kubeconfig(t testing.TB, user string) string {
	t.Helper()
	return cp.writeKubeconfig(t, filepath.Join(t.TempDir(), fileSafe(user)+".kubeconfig"), user, cp.token(t, user))
}

// ServiceAccountKubeconfig creates the ServiceAccount namespace/name if it does not
// exist, requests a token for it (TokenRequest, one hour) and writes a kubeconfig
// with it: the identity a DaemonSet's pod would have.
func (cp *ControlPlane) ServiceAccountKubeconfig(t testing.TB, namespace, name string) string {
	t.Helper()
	token := cp.ServiceAccountToken(t, namespace, name)
	user := "system:serviceaccount:" + namespace + ":" + name
	return cp.writeKubeconfig(t, filepath.Join(t.TempDir(), fileSafe(user)+".kubeconfig"), user, token)
}

// ServiceAccountToken creates the ServiceAccount namespace/name if needed and
// returns a token for it (TokenRequest, one hour) with the given audiences (none:
// the API server's own), as kubelet projects one into a pod.
func (cp *ControlPlane) ServiceAccountToken(t testing.TB, namespace, name string, audiences ...string) string {
	t.Helper()
	ctx, cancel := opContext(t)
	defer cancel()
	cp.EnsureNamespace(t, namespace)
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name}}
	if _, err := cp.client.CoreV1().ServiceAccounts(namespace).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("kubetest: create ServiceAccount %s/%s: %v", namespace, name, err)
	}
	expiry := int64(3600)
	tr, err := cp.client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &expiry, Audiences: audiences}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("kubetest: token for ServiceAccount %s/%s: %v", namespace, name, err)
	}
	return tr.Status.Token
}

func (cp *ControlPlane) writeKubeconfig(t testing.TB, path, user, token string) string {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kubetest"] = &clientcmdapi.Cluster{Server: cp.Host(), CertificateAuthorityData: cp.pki.caPEM}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["kubetest"] = &clientcmdapi.Context{Cluster: "kubetest", AuthInfo: user}
	cfg.CurrentContext = "kubetest"
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatalf("kubetest: write kubeconfig %s: %v", path, err)
	}
	return path
}

// BindClusterRole binds the ClusterRole role to user with a ClusterRoleBinding, so a
// test runs a client with exactly that role (the project's shipped ClusterRole).
// user is a user name: one of Options.Users, or a ServiceAccount's
// "system:serviceaccount:NS:NAME". It returns the binding's name.
func (cp *ControlPlane) BindClusterRole(t testing.TB, role, user string) string {
	t.Helper()
	ctx, cancel := opContext(t)
	defer cancel()
	name := "kubetest:" + fileSafe(user) + ":" + fileSafe(role)
	crb := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: user}},
	}
	if _, err := cp.client.RbacV1().ClusterRoleBindings().Create(ctx, crb, metav1.CreateOptions{}); err != nil {
		t.Fatalf("kubetest: bind ClusterRole %s to %s: %v", role, user, err)
	}
	return name
}

// Grant gives user rules: in namespace through a Role and RoleBinding, or
// cluster-wide (namespace "") through a ClusterRole and ClusterRoleBinding,
// all named name. The returned function deletes them again (what kubectl
// delete -k does to an app's roles).
func (cp *ControlPlane) Grant(t testing.TB, user, namespace, name string, rules []rbacv1.PolicyRule) (revoke func()) {
	t.Helper()
	ctx, cancel := opContext(t)
	defer cancel()
	c := cp.client.RbacV1()
	subjects := []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: user}}
	meta := metav1.ObjectMeta{Namespace: namespace, Name: name}
	var err error
	if namespace == "" {
		if _, err = c.ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: meta, Rules: rules}, metav1.CreateOptions{}); err == nil {
			_, err = c.ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: meta, Subjects: subjects,
				RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: name}}, metav1.CreateOptions{})
		}
	} else {
		if _, err = c.Roles(namespace).Create(ctx, &rbacv1.Role{ObjectMeta: meta, Rules: rules}, metav1.CreateOptions{}); err == nil {
			_, err = c.RoleBindings(namespace).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: meta, Subjects: subjects,
				RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: name}}, metav1.CreateOptions{})
		}
	}
	if err != nil {
		t.Fatalf("kubetest: grant %s to %s: %v", name, user, err)
	}
	return func() {
		ctx, cancel := opContext(t)
		defer cancel()
		if namespace == "" {
			_ = c.ClusterRoleBindings().Delete(ctx, name, metav1.DeleteOptions{})
			_ = c.ClusterRoles().Delete(ctx, name, metav1.DeleteOptions{})
		} else {
			_ = c.RoleBindings(namespace).Delete(ctx, name, metav1.DeleteOptions{})
			_ = c.Roles(namespace).Delete(ctx, name, metav1.DeleteOptions{})
		}
	}
}

var unsafeChars = regexp.MustCompile(`[^a-zA-Z0-9.-]+`)

// fileSafe turns a user or role name into something usable in file and object names.
func fileSafe(s string) string {
	return strings.Trim(unsafeChars.ReplaceAllString(strings.ToLower(s), "-"), "-")
}

// opContext bounds one API call of a helper: 30 s, ended with the test.
func opContext(t testing.TB) (context.Context, context.CancelFunc) {
	return context.WithTimeout(t.Context(), 30*time.Second)
}

// OpContext is opContext for a test's own API calls: cancelled when the
// test ends.
func OpContext(t testing.TB) context.Context {
	ctx, cancel := opContext(t)
	t.Cleanup(cancel)
	return ctx
}

// ShippedRules returns the rules of the ClusterRole name in file, a manifest
// of deploy/kubernetes: a test grants exactly what the install grants.
func ShippedRules(t testing.TB, file, name string) []rbacv1.PolicyRule {
	t.Helper()
	root, err := RepoRoot()
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	objs, err := readObjects(filepath.Join(root, "deploy", "kubernetes", file))
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	for _, u := range objs {
		if u.GetKind() != "ClusterRole" || u.GetName() != name {
			continue
		}
		var cr rbacv1.ClusterRole
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &cr); err != nil {
			t.Fatalf("kubetest: ClusterRole %s of %s: %v", name, file, err)
		}
		return cr.Rules
	}
	t.Fatalf("kubetest: no ClusterRole %s in deploy/kubernetes/%s", name, file)
	return nil
}
